"""Mid-stream migration bookkeeping (torch-free): what a client stream already got, and the request
that continues it on another pair.

The router relays whole worker chunks, so what the client has is exactly the token ids of the chunks
sent. A continuation is the original request with `resume_ids` = those ids: the worker prefills
prompt + them, counts them against max_tokens, replays them through its detokenizer (so its first
text delta starts exactly where the client's text ends) and skips their draws of a seeded
generator (engine/engine.py `make_request`). The router then fixes the final chunk's usage, which
the worker counts from the prompt it was given.
"""

from __future__ import annotations

import grpc

from tandem.v1 import generation_pb2


class StreamLedger:
    """The token ids a client stream has received, and how often it was migrated."""

    def __init__(self, request: generation_pb2.GenerateRequest, max_migrations: int):
        self.request = request
        self.max_migrations = max_migrations
        self.sent_ids: list[int] = []
        self.chunks = 0
        self.migrations = 0
        self.resumed = 0  # tokens the current attempt was given as resume_ids
        self.finished = False

    def record(self, msg: generation_pb2.GenerateResponse) -> generation_pb2.GenerateResponse:
        """Account for a chunk about to go to the client; returns it with the usage of the whole stream."""
        assert not self.finished, "a chunk after the final one"
        if self.migrations and msg.HasField("usage"):
            # The continuing worker counted the resumed tokens as prompt: they are completion.
            msg.usage.prompt_tokens -= self.resumed
            msg.usage.completion_tokens += self.resumed
            msg.usage.cached_tokens = min(msg.usage.cached_tokens, msg.usage.prompt_tokens)
        self.sent_ids.extend(msg.token_ids)
        self.chunks += 1
        self.finished = msg.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED
        return msg

    def why_not(self, code: grpc.StatusCode, max_tokens: int | None) -> str | None:
        """None if a failure with `code` may be migrated now, else the metric outcome saying why not.
        Only a broken stream (UNAVAILABLE: worker gone, stream reset, a failed KV transfer) after
        something was sent qualifies; a request's own errors (INVALID_ARGUMENT, ...) never do.
        `max_tokens`: the request's explicit limit (None: the worker's default, which it checks)."""
        if code != grpc.StatusCode.UNAVAILABLE or not self.chunks or self.finished:
            return "not_migratable"
        if self.migrations >= self.max_migrations:
            return "exhausted"
        if max_tokens is not None and len(self.sent_ids) >= max_tokens:
            return "unsupported"
        return None

    def continuation(self) -> generation_pb2.GenerateRequest:
        """The request that continues the stream after everything sent so far; counts a migration."""
        self.migrations += 1
        self.resumed = len(self.sent_ids)
        req = generation_pb2.GenerateRequest()
        req.CopyFrom(self.request)
        req.resume_ids[:] = self.sent_ids  # clients may not set it (validation.py)
        return req
