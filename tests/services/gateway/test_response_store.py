"""The Responses API's store: bounded, expiring, shared through Redis (the embedded redis-server the
launcher runs) or kept in the gateway's memory."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.errors import APIError
from tandem.services.gateway.response_store import MemoryStore, RedisStore, open_store
from tandem.services.launcher.redis_server import EmbeddedRedis

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = EmbeddedRedis(str(tmp_path_factory.mktemp("redis")))
    server.start()
    try:
        yield server.url
    finally:
        server.close()


def _exercise(make):
    async def go():
        store = make(size=3, ttl_s=60)
        try:
            for i in range(5):
                await store.put(f"r{i}", {"response": {"id": f"r{i}"}, "messages": [{"role": "user", "content": "é"}]})
            kept = [rid for rid in (f"r{i}" for i in range(5)) if await store.get(rid) is not None]
            got = await store.get("r4")
            deleted = await store.delete("r4"), await store.delete("r4"), await store.get("r4")
            return kept, got, deleted
        finally:
            await store.close()

    kept, got, deleted = asyncio.run(go())
    assert kept == ["r2", "r3", "r4"]                        # the oldest go first
    assert got == {"response": {"id": "r4"}, "messages": [{"role": "user", "content": "é"}]}
    assert deleted == (True, False, None)


def test_memory_store_is_bounded():
    _exercise(lambda size, ttl_s: MemoryStore(size, ttl_s))


def test_redis_store_is_bounded_and_shared(redis_url):
    _exercise(lambda size, ttl_s: RedisStore(redis_url, size, ttl_s))

    async def shared():
        a, b = RedisStore(redis_url, 10, 60), RedisStore(redis_url, 10, 60)
        try:
            await a.put("x", {"response": {"id": "x"}})
            return await b.get("x")
        finally:
            await a.close()
            await b.close()

    assert asyncio.run(shared()) == {"response": {"id": "x"}}   # another gateway on the same Redis sees it


def test_records_expire():
    async def go(store):
        await store.put("r", {"response": {}})
        await asyncio.sleep(1.2)
        return await store.get("r")

    assert asyncio.run(go(MemoryStore(10, 0.5))) is None


def test_redis_records_expire(redis_url):
    async def go():
        store = RedisStore(redis_url, 10, 1)
        try:
            await store.put("short", {"response": {}})
            present = await store.get("short")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and await store.get("short") is not None:
                await asyncio.sleep(0.2)
            return present, await store.get("short")
        finally:
            await store.close()

    present, after = asyncio.run(go())
    assert present is not None and after is None


def test_the_store_follows_the_config(redis_url):
    assert isinstance(open_store(GatewayConfig()), MemoryStore)
    assert isinstance(open_store(GatewayConfig(redis_url=redis_url)), RedisStore)
    with pytest.raises(ValueError):
        GatewayConfig(response_store_size=0).validate()


def test_an_unreachable_redis_is_a_503(tmp_path):
    async def go():
        store = RedisStore(f"unix://{tmp_path}/nobody.sock", 10, 60)
        try:
            with pytest.raises(APIError) as e:
                await store.get("r")
            return e.value
        finally:
            await store.close()

    err = asyncio.run(go())
    assert err.status == 503 and "response store" in err.message
