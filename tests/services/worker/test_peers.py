"""PeerMonitor: a peer that stops answering its liveness probe fails only its own rooms."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.services.common import keepalive
from tandem.services.worker.peers import LIVENESS, PeerMonitor
from tests.services.common.conftest import arun
from tests.services.router.fakes import dead_addr


class InlineLoop:
    """EngineLoop's call/post, run inline (the monitor's only contact with the engine thread)."""

    def call(self, fn):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(fn())
        return fut

    def post(self, fn) -> None:
        fn()


class Worker:
    def __init__(self, peers: dict[str, str]):
        self.peers = peers
        self.lost: list[tuple[str, str]] = []

    def watched_peers(self) -> dict[str, str]:
        return dict(self.peers)

    def peer_lost(self, peer_id: str, reason: str) -> None:
        self.lost.append((peer_id, reason))
        self.peers.pop(peer_id, None)   # its rooms failed: no longer watched


def test_only_the_silent_peer_is_reported_after_three_misses():
    async def body():
        server = grpc.aio.server(options=keepalive.SERVER_OPTIONS)  # as the real workers'
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        await servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        worker = Worker({"alive": f"127.0.0.1:{port}", "dead": dead_addr()})
        monitor = PeerMonitor(InlineLoop(), worker, period_s=0.05, misses=3)
        try:
            for _ in range(2):
                await monitor.probe_once()
            assert worker.lost == []                 # two misses are not yet a verdict
            await monitor.probe_once()
            assert [p for p, _ in worker.lost] == ["dead"]
            assert "failed 3 times in a row (UNAVAILABLE" in worker.lost[0][1]
            await servicer.set(LIVENESS, health_pb2.HealthCheckResponse.NOT_SERVING)
            for _ in range(3):
                await monitor.probe_once()
            assert [p for p, _ in worker.lost] == ["dead", "alive"]
            assert "NOT_SERVING" in worker.lost[1][1]
            monitor.start()                           # the background loop runs and closes cleanly
            await asyncio.sleep(0.12)
        finally:
            await monitor.close()
            await monitor.close()
            await server.stop(0)

    arun(body())
