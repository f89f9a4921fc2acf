"""Peer liveness: a worker probes the peers it holds rooms with, and fails only their rooms when one dies.

A decode worker watches the prefill workers whose KV it waits for; a prefill worker watches the
decode workers it writes to. A dead process is usually noticed sooner (its transfer connection or
gRPC call breaks); this catches the peer that is alive to the kernel but not serving (stopped,
wedged, partitioned), whose connections stay open. Each watched peer's gRPC health `liveness`
service (it stays SERVING through a drain) is checked every `period_s`; after `misses` failed probes
in a row, `worker.peer_lost(peer_id, reason)` runs on the engine thread, which fails that peer's
rooms through their normal exit (an abort that returns only once no write of the room can land).

The worker (a StepWorker) provides `watched_peers() -> {peer_id: grpc_addr}` and `peer_lost`.
Lifecycle: create -> start() -> close(); close is safe to call twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.common import keepalive

log = logging.getLogger(__name__)

LIVENESS = "liveness"
# A refused probe must not leave the channel in gRPC's default minutes-long reconnect backoff: the
# next probe would fail fast without asking a peer that may be back.
_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500),
                    *keepalive.CLIENT_OPTIONS)


class PeerMonitor:
    def __init__(self, engine_loop, worker, period_s: float = 1.0, misses: int = 3):
        assert period_s > 0 and misses >= 1
        self.engine_loop = engine_loop
        self.worker = worker
        self.period_s = period_s
        self.timeout_s = max(1.0, period_s)
        self.misses = misses
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._missed: dict[str, int] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="peer-monitor")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.probe_once()
            except Exception:  # the monitor must outlive its own bugs
                log.exception("peer liveness probe failed")

    async def probe_once(self) -> None:
        peers: dict[str, str] = await self.engine_loop.call(self.worker.watched_peers)
        for gone in [a for a in self._channels if a not in peers.values()]:
            await self._channels.pop(gone).close()
        self._missed = {p: n for p, n in self._missed.items() if p in peers}
        results = await asyncio.gather(*(self._probe(addr) for addr in peers.values()))
        for (peer, addr), error in zip(peers.items(), results, strict=True):
            if error is None:
                self._missed.pop(peer, None)
                continue
            n = self._missed[peer] = self._missed.get(peer, 0) + 1
            if n >= self.misses:
                del self._missed[peer]
                reason = f"its liveness probe at {addr} failed {n} times in a row ({error})"
                log.warning("peer %s is unreachable: %s; failing its requests", peer, reason)
                self.engine_loop.post(lambda peer=peer, reason=reason: self.worker.peer_lost(peer, reason))

    async def _probe(self, addr: str) -> str | None:
        """None when the peer answers SERVING, else why not."""
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = grpc.aio.insecure_channel(addr, options=_CHANNEL_OPTIONS)
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=LIVENESS), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            return f"{e.code().name}: {e.details()}"
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        return None
