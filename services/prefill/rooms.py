"""A prefill worker's rooms: the bootstrap queue and the inflight transfers (torch-free)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.scheduler.request import Request
from tandem.kvtransfer.base import RoomState


@dataclass(frozen=True)
class BootstrapInfo:
    """Where D wants the room's KV: D's page ids for prompt pages `first_page ...` in order."""

    peer_id: str
    dst_pages: list[int]
    decode_prefix_len: int          # tokens D already holds (page-aligned): P does not send them
    peer_addr: str = ""             # D's gRPC address, for its liveness probe ("" : not watched)
    lora_digest: str = ""           # D's adapter for the room ("": the base model); must be P's too
    peer_epoch: int = 0             # D's boot epoch (0: unchecked): a fetch from it takes only that instance's writes


@dataclass(eq=False)
class PrefillRoom:
    room: int
    created: float = field(default_factory=time.monotonic)
    req: Request | None = None                  # set when the router's Prefill arrives
    info: BootstrapInfo | None = None           # set when D's Bootstrap arrives
    state: RoomState = RoomState.BOOTSTRAPPING
    next_page: int = 0                          # next prompt page index to send
    finished_at: float | None = None            # when the aux record was queued
    error: str = ""
    rejection: BaseException | None = None      # the Prefill RPC fails with this status instead (queue full)
    on_done: Callable[[PrefillRoom], None] | None = None  # resolves the Prefill RPC
    reuse_decode_kv: bool = False               # fetch what D holds beyond P's cache (PrefillRequest.reuse_decode_kv)
    # Its prefill starts when the router's Prefill arrives, before D's Bootstrap (unless it fetches
    # from D, which needs D's answer first): what it computes meanwhile is sent once D's pages are known.
    computed: int = 0                           # prompt tokens whose KV is in P's pool (finished steps)
    early_token: object | None = None           # the first token, sampled before D's Bootstrap came
    # Stamps for the request's trace (services/worker/trace.py), time.monotonic(): when it entered the
    # scheduler, and (step start, step end, tokens) of each step that ran one of its chunks.
    started_at: float | None = None
    chunks: list[tuple[float, float, int]] = field(default_factory=list)
    waited_bootstrap: tuple[float, float] | None = None   # its prefill was done before D's Bootstrap came

    @property
    def ready(self) -> bool:
        return self.req is not None and self.info is not None

    def pages_to_send(self, page_size: int, num_computed: int, final: bool) -> tuple[list[int], list[int]]:
        """(src, dst) pages newly complete since the last call; all remaining ones when `final`."""
        assert self.req is not None and self.info is not None
        first = self.info.decode_prefix_len // page_size
        total = -(-len(self.req.prompt_ids) // page_size)
        upto = total if final else min(total, num_computed // page_size)
        start = max(self.next_page, first)
        if upto <= start:
            return [], []
        src = self.req.pages[start:upto]
        dst = self.info.dst_pages[start - first:upto - first]
        self.next_page = upto
        return src, dst
