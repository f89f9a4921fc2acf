"""The workers' request spans (services/common/tracing.py), kept out of the servicers.

The engine thread only stamps `time.monotonic()` on its rooms (DecodeRoom.created / bootstrapped_at /
kv_ready_at); the spans are built here, on the event loop, once the request is over, with those
stamps as explicit start and end times. Every function is a no-op while tracing is off.
"""

from __future__ import annotations

import time

from tandem.services.common import tracing

# bootstrap room -> the decode span of the request it belongs to, so the Bootstrap call that the
# engine thread asks for (BootstrapClient) joins the request's trace. Only filled while tracing is on.
_ROOM_SPANS: dict[int, object] = {}


class StreamTrace:
    """One streamed generation (a Decode call, or a co-located worker's Generate). On a decode
    worker, with its room: admission (prealloc queue + pages), the wait for the KV, the first token;
    on a co-located one: the time to its first token (queue + prefill)."""

    def __init__(self, name: str, context, request, attributes: dict, room_id: int | None = None):
        self.started = time.monotonic()
        self.room_id = room_id
        self.span = tracing.start(name, tracing.extract(context.invocation_metadata()), server=True,
                                  start_s=self.started, attributes={
                                      "tandem.request_id": request.request_id,
                                      "gen_ai.request.max_tokens": request.sampling.max_tokens, **attributes})
        if room_id is not None:
            _ROOM_SPANS[room_id] = self.span
        self.room = None
        self.first_at: float | None = None
        self.tokens = 0
        self.usage = None

    def output(self, item) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.tokens += len(item.token_ids)
        self.usage = item.usage or self.usage

    def finish(self, error: str | None = None) -> None:
        _ROOM_SPANS.pop(self.room_id, None)
        room, span = self.room, self.span
        if self.room_id is None:
            tracing.record("colocated.first_token", span, self.started, self.first_at)
        if room is not None:
            tracing.record("decode.admission", span, room.created, room.bootstrapped_at)
            tracing.record("decode.wait_kv", span, room.bootstrapped_at, room.kv_ready_at)
            ready = room.kv_ready_at or room.bootstrapped_at or room.created
            tracing.record("decode.first_token", span, ready, self.first_at)
        attrs = {"gen_ai.usage.output_tokens": self.tokens}
        if (usage := self.usage) is not None:
            attrs.update({"gen_ai.usage.input_tokens": usage.prompt_tokens,
                          "gen_ai.usage.output_tokens": usage.completion_tokens,
                          "tandem.cached_tokens": usage.cached_tokens})
        tracing.end(span, attrs, error=error)


def decode_trace(context, request) -> StreamTrace | None:
    if not tracing.enabled():
        return None
    return StreamTrace("tandem.decode", context, request, {
        "tandem.bootstrap_room": request.bootstrap_room, "tandem.prefill_worker": request.prefill_worker_id,
        "tandem.local_prefill": request.local_prefill}, room_id=request.bootstrap_room)


def colocated_trace(context, request) -> StreamTrace | None:
    if not tracing.enabled():
        return None
    return StreamTrace("tandem.colocated", context, request, {"gen_ai.request.model": request.model})


def bootstrap_span(room_id: int):
    """A client span for D's Bootstrap call of `room_id` (None when off or the room is not traced)."""
    parent = _ROOM_SPANS.get(room_id)
    return tracing.start("decode.bootstrap", parent, {"tandem.bootstrap_room": room_id}) if parent else None


def prefill_span(context, request):
    """The Prefill call's span, started now (None when off)."""
    return tracing.start("tandem.prefill", tracing.extract(context.invocation_metadata()), server=True,
                         attributes={"tandem.request_id": request.request_id,
                                     "tandem.bootstrap_room": request.bootstrap_room})


def end_prefill(span, resp, sender, room=None) -> None:
    """The prefill span and its phases from the room's engine stamps: waiting for D's Bootstrap (before
    the prefill when it fetches from D, after it when the prefill was done first), the queue, each
    chunk's step, and the KV transfer's tail (from the last chunk's aux record to the
    transfer's completion; pages of earlier chunks went out after each chunk)."""
    if span is None:
        return
    now = time.monotonic()
    if room is not None:
        began = span.start_time / 1e9 - time.time() + now      # the span's start as a monotonic stamp
        if room.started_at is not None and room.started_at > began:
            tracing.record("prefill.wait_bootstrap", span, began, room.started_at)
        if room.waited_bootstrap is not None:   # computed before D's Bootstrap, and done before it came
            tracing.record("prefill.wait_bootstrap", span, *room.waited_bootstrap)
        if room.chunks:
            tracing.record("prefill.queue", span, room.started_at, room.chunks[0][0])
        for i, (start, end, tokens) in enumerate(room.chunks):
            tracing.record("prefill.chunk", span, start, end, {"tandem.chunk": i, "tandem.chunk.tokens": tokens})
    if not isinstance(resp, BaseException):
        start = room.finished_at if room is not None and room.finished_at is not None else now - resp.transfer_ms / 1e3
        tracing.record("prefill.kv_transfer", span, start, now,
                       {"tandem.kv.bytes": resp.transfer_bytes, "tandem.kv.backend": _backend(sender, room),
                        "tandem.kv.transfer_ms": resp.transfer_ms})
        tracing.end(span, {"tandem.cached_tokens": resp.cached_tokens, "tandem.transfer_state": resp.state},
                    error=resp.error or None)
    else:
        tracing.end(span, error=str(resp))


def _backend(sender, room) -> str:
    """The data path the room's KV took ("shm", "tcp", ...; with `auto`, the one chosen for its peer),
    else the sender's configured backend."""
    path_kind = getattr(sender, "path_kind", None)
    if path_kind is not None and room is not None and room.info is not None:
        try:
            return path_kind(room.info.peer_id)
        except KeyError:   # the peer is gone since
            pass
    return getattr(sender, "name", "") or type(sender).__name__
