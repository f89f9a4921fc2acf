"""grpc.aio channels to workers, one per address, closed when the worker leaves the registry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A restarted worker on the same address is reachable again within ~1 s, not minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)   # InternalAuth.channel adds keepalive: a partitioned or frozen worker fails its streams within seconds


class ChannelPool:
    """Lifecycle: get() creates on demand; retain() drops channels of departed workers, letting their
    in-flight calls finish for up to `close_grace_s`; close() closes everything (idempotent)."""

    def __init__(self, close_grace_s: float = 30.0,
                 channel: Callable[..., grpc.aio.Channel] = grpc.aio.insecure_channel):
        """`channel(addr, options=...)` opens a channel (InternalAuth.channel: calls carry the secret)."""
        self.close_grace_s = close_grace_s
        self._open = channel
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: set[asyncio.Task] = set()

    def get(self, addr: str) -> grpc.aio.Channel:
        channel = self._channels.get(addr)
        if channel is None:
            channel = self._channels[addr] = self._open(addr, options=CHANNEL_OPTIONS)
        return channel

    def addresses(self) -> list[str]:
        return list(self._channels)

    def retain(self, live: Iterable[str]) -> None:
        live = set(live)
        for addr in [a for a in self._channels if a not in live]:
            log.info("closing channel to %s (left the registry)", addr)
            task = asyncio.create_task(self._channels.pop(addr).close(self.close_grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for task in list(self._closing):
            task.cancel()
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
