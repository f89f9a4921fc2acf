"""keepalive.py's options do what its docstring says: a peer that stops answering (here: SIGSTOP, so
its kernel still ACKs TCP and only the process is silent) fails an open stream within DETECT_BOUND_S;
without them the stream waits. A server with SERVER_OPTIONS accepts pings that often."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.services.common import keepalive

pytestmark = pytest.mark.timeout(60)

SERVER = textwrap.dedent("""
    import asyncio, itertools, grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from tandem.services.common import keepalive

    async def main():
        server = grpc.aio.server(options=keepalive.SERVER_OPTIONS)
        h = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(h, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        for i in itertools.count():   # a stream of status changes, as a worker streams tokens
            await asyncio.sleep(0.2)
            await h.set("", health_pb2.HealthCheckResponse.SERVING if i % 2 else health_pb2.HealthCheckResponse.UNKNOWN)

    asyncio.run(main())
""")


async def _silence_after(options, wait_s: float) -> tuple[float | None, int]:
    """Watch a stream, freeze the server after some messages; seconds from the freeze to the error
    (None: none within wait_s), and the messages received."""
    proc = subprocess.Popen([sys.executable, "-P", "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = proc.stdout.readline().strip()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
            stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
            received, frozen = 0, None
            try:
                async with asyncio.timeout(wait_s + 3):
                    async for _ in stream:
                        received += 1
                        if received == 5:
                            os.kill(proc.pid, signal.SIGSTOP)
                            frozen = time.monotonic()
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                return time.monotonic() - frozen, received
            except TimeoutError:
                return None, received
            raise AssertionError("the stream ended by itself")
    finally:
        proc.kill()
        proc.wait()


def test_a_silent_peer_fails_the_stream_within_the_bound():
    took, received = asyncio.run(_silence_after(keepalive.CLIENT_OPTIONS, keepalive.DETECT_BOUND_S + 2))
    assert received == 5
    assert took is not None and took <= keepalive.DETECT_BOUND_S + 1, took


def test_without_keepalive_the_stream_waits():
    took, _ = asyncio.run(_silence_after((), keepalive.DETECT_BOUND_S + 2))
    assert took is None
