"""Client disconnects cancel work: an SSE response whose producer is cancelled when the client goes away,
and a helper that does the same for a non-streaming handler.

Cancelling the producer closes the router's gRPC call, which makes the router abort the request on
its prefill and decode workers (their pages are freed). Starlette's StreamingResponse only notices a
gone client on its next write under ASGI 2.4, which for a request still queued on a worker can be
a long time; these watch `receive()` for `http.disconnect` instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its response was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _race(work: asyncio.Future, receive: Receive) -> bool:
    """Wait for `work`; True when it finished, False when the client left first (work is then cancelled)."""
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work.done():
        return True
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await work
    return False


async def until_disconnect(request: Request, coro: Awaitable[T]) -> T:
    """Await `coro`; cancel it and raise ClientDisconnected if the client goes away first."""
    work = asyncio.ensure_future(coro)
    try:
        if not await _race(work, request.receive):
            raise ClientDisconnected()
    except asyncio.CancelledError:
        work.cancel()
        raise
    return work.result()


class EventStream(Response):
    """An ASGI `text/event-stream` response over an async iterator of already-framed SSE bytes.

    `on_close` runs exactly once when the response is over for any reason (done, client gone, server
    shutting down), even if the body never started: that is where the caller releases what it holds.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]] | None = None,
                 status_code: int = 200):
        # Not Response.__init__: it would render a body and a content-length.
        self.body_iterator = body
        self.on_close = on_close
        self.status_code = status_code
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        work = asyncio.ensure_future(pump())
        try:
            finished = await _race(work, receive)
        except asyncio.CancelledError:
            work.cancel()
            raise
        finally:
            if work.done():  # else the body is still running in `work`: it closes as its cancellation unwinds
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            if self.on_close is not None:
                await self.on_close()
        if finished:
            work.result()  # re-raise a failure of the producer (the server logs it)
