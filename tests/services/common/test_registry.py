from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem.services.common.registry import RedisRegistry, StaticRegistry, create_registry, registry_names
from tandem.v1 import worker_pb2
from tests.services.common.conftest import arun, wait_until

PREFILL = worker_pb2.WORKER_ROLE_PREFILL
DECODE = worker_pb2.WORKER_ROLE_DECODE


def _info(worker_id: str, role=PREFILL, **kw) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(worker_id=worker_id, role=role, grpc_addr=f"{worker_id}:1", model="m", **kw)


def test_announce_heartbeat_load_and_withdraw(redis_url):
    async def body():
        router = RedisRegistry(redis_url, poll_s=0.05)
        worker = RedisRegistry(redis_url, ttl_s=1.0, heartbeat_s=0.05, watch=False)
        changes = []

        async def on_change():
            changes.append([w.worker_id for w in router.all_workers()])

        router.add_listener(on_change)
        await router.start()
        await worker.start()
        assert router.workers(PREFILL) == []

        await worker.announce(_info("p0", bootstrap_addr="p0:2", max_context_len=2048, vocab_size=99))
        await wait_until(lambda: router.workers(PREFILL))
        [seen] = router.workers(PREFILL)
        assert (seen.worker_id, seen.bootstrap_addr, seen.max_context_len, seen.vocab_size) == ("p0", "p0:2", 2048, 99)
        assert router.workers(DECODE) == []

        worker.update_load(worker_pb2.WorkerLoad(running=3, waiting=4, free_pages=5, total_pages=8))
        await wait_until(lambda: router.workers(PREFILL)[0].load.running == 3)
        assert router.workers(PREFILL)[0].load.waiting == 4
        # A load change is not a membership change: listeners fired once for the arrival only.
        assert changes == [["p0"]]

        await worker.withdraw()
        await router.refresh()  # withdraw deletes the key: gone at the next scan, not after the TTL
        assert router.workers(PREFILL) == []
        assert changes == [["p0"], []]
        await worker.close()
        await worker.close()  # safe twice
        await router.close()
        await router.close()

    arun(body())


def test_dead_worker_expires_after_ttl(redis_url):
    async def body():
        router = RedisRegistry(redis_url, poll_s=0.05)
        worker = RedisRegistry(redis_url, ttl_s=0.4, heartbeat_s=0.1, watch=False)
        await router.start()
        await worker.start()
        await worker.announce(_info("d0", role=DECODE))
        await wait_until(lambda: router.workers(DECODE))
        await asyncio.sleep(0.6)  # longer than the TTL: heartbeats keep it alive
        assert [w.worker_id for w in router.workers(DECODE)] == ["d0"]

        # Simulate a crash: heartbeats stop and nobody deletes the key.
        worker._heartbeat_task.cancel()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await wait_until(lambda: not router.workers(DECODE), timeout=2.0)
        assert loop.time() - t0 < 0.4 + 0.8  # TTL plus a poll, with slack for a busy machine
        await worker.close()
        await router.close()

    arun(body())


def test_workers_are_listed_by_id_and_role(redis_url):
    async def body():
        router = RedisRegistry(redis_url, poll_s=10)  # background poll out of the way: refresh() by hand
        workers = [RedisRegistry(redis_url, watch=False) for _ in range(3)]
        await router.start()
        for reg, info in zip(workers, [_info("p1"), _info("d0", role=DECODE), _info("p0")], strict=True):
            await reg.start()
            await reg.announce(info)
        await router.refresh()
        assert [w.worker_id for w in router.workers(PREFILL)] == ["p0", "p1"]
        assert [w.worker_id for w in router.workers(DECODE)] == ["d0"]
        for reg in workers:
            await reg.close()
        await router.refresh()
        assert router.all_workers() == []
        await router.close()

    arun(body())


def test_prefixes_are_isolated(redis_url):
    async def body():
        a = RedisRegistry(redis_url, prefix="a", poll_s=10)
        b = RedisRegistry(redis_url, prefix="b", watch=False)
        await a.start()
        await b.start()
        await b.announce(_info("p0"))
        await a.refresh()
        assert a.all_workers() == []
        await b.close()
        await a.close()

    arun(body())


def test_unreachable_redis_is_logged_not_raised(tmp_path, caplog):
    async def body():
        url = f"unix://{tmp_path}/nothing.sock"
        router = RedisRegistry(url, poll_s=0.05, ttl_s=0.5, heartbeat_s=0.05)
        await router.start()  # no exception
        await router.announce(_info("p0"))  # no exception; the heartbeat keeps retrying
        await asyncio.sleep(0.2)
        assert router.workers(PREFILL) == []
        assert not router._heartbeat_task.done() and not router._poll_task.done()
        await router.close()

    arun(body())
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "will retry" in r.getMessage()]
    assert len(warnings) == 2  # one per outage for scans and one for heartbeats, not one per retry


def test_redis_registry_rejects_heartbeat_slower_than_ttl():
    with pytest.raises(ValueError, match="heartbeat_s"):
        RedisRegistry("redis://x", ttl_s=1.0, heartbeat_s=1.0)


def test_static_registry_keeps_order_and_roles():
    async def body():
        reg = StaticRegistry(prefill=["b:1", "a:1"], decode=["c:1"], model="m", probe_s=0)
        await reg.start()
        assert [w.worker_id for w in reg.workers(PREFILL)] == ["b:1", "a:1"]
        [d] = reg.workers(DECODE)
        assert (d.grpc_addr, d.bootstrap_addr, d.model) == ("c:1", "c:1", "m")
        with pytest.raises(NotImplementedError):
            await reg.announce(_info("x"))
        await reg.close()
        await reg.close()

    arun(body())


def test_static_registry_probe_drops_dead_and_not_serving():
    from tests.services.router.fakes import dead_addr

    async def serve(status):
        server = grpc.aio.server()
        if status is not None:
            h = health.aio.HealthServicer()
            await h.set("", status)
            health_pb2_grpc.add_HealthServicer_to_server(h, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}", (h if status is not None else None)

    async def body():
        serving, a_serving, h = await serve(health_pb2.HealthCheckResponse.SERVING)
        sick, a_sick, _ = await serve(health_pb2.HealthCheckResponse.NOT_SERVING)
        plain, a_plain, _ = await serve(None)  # no health service: reachable is enough
        dead = dead_addr()
        reg = StaticRegistry(prefill=[a_serving, a_sick, a_plain, dead], probe_s=0.05, probe_timeout_s=0.5)
        await reg.start()
        assert [w.worker_id for w in reg.workers(PREFILL)] == [a_serving, a_plain]
        await h.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await wait_until(lambda: [w.worker_id for w in reg.workers(PREFILL)] == [a_plain])
        await reg.close()
        for s in (serving, sick, plain):
            await s.stop(0)

    arun(body())


def test_static_registry_learns_what_each_address_is_and_a_restart():
    # A listed address is asked what is there: pairing needs the worker's id and boot epoch, not its address.
    from tests.services.common.fake_worker import FakeWorker
    from tests.services.router.fakes import dead_addr

    port = int(dead_addr().rsplit(":", 1)[1])

    async def body():
        worker = await FakeWorker("127.0.0.1", port, PREFILL, "prefill-host-7", "", 11).start()
        worker.info.grpc_addr = worker.info.bootstrap_addr = "advertised-host:9"   # not what the router dials
        addr = f"127.0.0.1:{port}"
        reg = StaticRegistry(prefill=[addr], decode=[addr], probe_s=0.05, probe_timeout_s=0.5)
        await reg.start()
        [p] = reg.workers(PREFILL)
        assert (p.worker_id, p.boot_epoch, p.model, p.max_context_len) == ("prefill-host-7", 11, "tiny", 256)
        assert (p.grpc_addr, p.bootstrap_addr) == (addr, addr)
        assert reg.workers(DECODE) == []            # the worker there is not a decode worker
        await worker.stop()
        await wait_until(lambda: not reg.workers(PREFILL))
        restarted = await FakeWorker("127.0.0.1", port, PREFILL, "prefill-host-8", "", 12).start()
        await wait_until(lambda: [(w.worker_id, w.boot_epoch) for w in reg.workers(PREFILL)] == [("prefill-host-8", 12)])
        await reg.close()
        await restarted.stop()

    arun(body())


def test_static_registry_without_probes_asks_once_and_keeps_every_address():
    from tests.services.common.fake_worker import FakeWorker
    from tests.services.router.fakes import dead_addr

    port, dead = int(dead_addr().rsplit(":", 1)[1]), dead_addr()

    async def body():
        worker = await FakeWorker("127.0.0.1", port, DECODE, "decode-host-1", "", 5).start()
        reg = StaticRegistry(decode=[f"127.0.0.1:{port}", dead], model="m", probe_s=0, probe_timeout_s=0.5)
        await reg.start()
        assert [(w.worker_id, w.model) for w in reg.workers(DECODE)] == [("decode-host-1", "tiny"), (dead, "m")]
        await reg.close()
        await worker.stop()

    arun(body())


def test_registry_factory():
    assert {"redis", "static"} <= set(registry_names())
    assert isinstance(create_registry("static", prefill=["a:1"]), StaticRegistry)
    with pytest.raises(ValueError, match="unknown registry"):
        create_registry("zookeeper")


def test_redis_restart_workers_reannounce_and_the_router_keeps_them_meanwhile(tmp_path):
    from tandem.services.launcher.redis_server import EmbeddedRedis

    redis = EmbeddedRedis(str(tmp_path))
    redis.start()

    async def body():
        router = RedisRegistry(redis.url, poll_s=0.05)
        worker = RedisRegistry(redis.url, ttl_s=1.0, heartbeat_s=0.1, watch=False)
        await router.start()
        await worker.start()
        await worker.announce(_info("p0"))
        await wait_until(lambda: router.workers(PREFILL))
        redis.child.kill()
        redis.child.wait(5)
        await asyncio.sleep(0.3)                       # Redis down: the last known snapshot serves
        assert [w.worker_id for w in router.workers(PREFILL)] == ["p0"]
        await asyncio.to_thread(redis.start)           # empty, on the same socket
        await router.refresh()
        assert [w.worker_id for w in router.workers(PREFILL)] == ["p0"]   # not dropped while re-announcing
        import redis.asyncio as aioredis

        client = aioredis.from_url(redis.url)
        for _ in range(100):                           # the worker's heartbeat wrote its key again
            if await client.exists(worker.key("p0")):
                break
            await asyncio.sleep(0.05)
        assert await client.exists(worker.key("p0"))
        await client.aclose()
        await worker.close()
        await router.close()

    try:
        arun(body())
    finally:
        redis.close()


def test_after_an_outage_the_router_keeps_known_workers_for_a_ttl_while_they_reannounce(redis_url):
    """Redis unreachable from both sides (a partition) for longer than the TTL: the workers' keys
    expired meanwhile. The router's first scan that works again must not drop every worker at once
    (that failed requests in the network chaos drill); workers still gone after a TTL are dropped."""
    async def body():
        router = RedisRegistry(redis_url, ttl_s=1.0, heartbeat_s=0.1, watch=False)
        await router.start()
        live = RedisRegistry(redis_url, ttl_s=1.0, heartbeat_s=0.1, watch=False)
        await live.start()
        await live.announce(_info("p0"))
        await router.announce(_info("p1"))   # the router's client also writes p1's key (a worker that will not come back)
        await router.refresh()
        assert [w.worker_id for w in router.workers(PREFILL)] == ["p0", "p1"]

        real_scan = router._client.scan_iter

        def down(*a, **kw):
            raise ConnectionError("partitioned")

        router._client.scan_iter = down
        await router.refresh()                         # fails: the last known workers stay
        await router.withdraw()                        # p1 is gone for good
        await router._client.delete(live.key("p0"))   # p0's key expired during the outage ...
        router._client.scan_iter = real_scan
        await router.refresh()                         # ... reachable again, p0 not re-announced yet
        assert [w.worker_id for w in router.workers(PREFILL)] == ["p0", "p1"]
        await asyncio.sleep(1.1)                       # one TTL: p0's heartbeat wrote it again, p1 did not
        await router.refresh()
        assert [w.worker_id for w in router.workers(PREFILL)] == ["p0"]
        await live.close()
        await router.close()

    arun(body())


def test_a_write_that_swallows_its_cancellation_does_not_hang_the_withdraw(redis_url, monkeypatch):
    """The CI hang (2026-12-05): a worker SIGSTOPped and resumed was cancelled inside its heartbeat's
    Redis write, the client turned the CancelledError into an error that the write logs, and the loop
    slept on: `withdraw()` awaited it forever and the launcher SIGKILLed the worker. Now the loop sees
    the pending cancellation and ends."""
    async def body():
        worker = RedisRegistry(redis_url, ttl_s=1.0, heartbeat_s=0.05, watch=False)
        await worker.start()
        await worker.announce(_info("p0"))
        entered = asyncio.Event()

        async def swallowing_set(*args, **kwargs):
            entered.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                raise ConnectionError("the connection was closed mid-command") from None

        monkeypatch.setattr(worker._client, "set", swallowing_set)
        await asyncio.wait_for(entered.wait(), 5)
        task = worker._heartbeat_task
        t0 = asyncio.get_running_loop().time()
        await worker.withdraw()
        assert asyncio.get_running_loop().time() - t0 < 1.0
        assert task.done()
        await worker.close()

    arun(body())
