"""Where the Responses API keeps responses for `GET /v1/responses/{id}`, `previous_response_id`,
`input_items` and `DELETE`: the deployment's Redis (`--redis-url`; `tandem up` passes its own), or,
for a gateway started without one, a bounded map in this process.

A record holds the response object as it was returned, its input items, and the whole conversation
as chat messages (earlier turns, this input, this output), which is what a follow-up's prompt is
built from. Both stores keep at most `--response-store-size` records, each for at most
`--response-store-ttl` seconds (the oldest go first), and nothing at all for `store: false`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from tandem.services.gateway.config import GatewayConfig
from tandem.services.gateway.errors import APIError

_PREFIX = "tandem:responses:"
_INDEX = _PREFIX + "index"   # sorted set: id by the time it was stored (oldest evicted first)


class ResponseStore(Protocol):
    async def put(self, rid: str, record: dict) -> None: ...

    async def get(self, rid: str) -> dict | None: ...

    async def delete(self, rid: str) -> bool: ...

    async def close(self) -> None: ...


class MemoryStore:
    """This process's store: insertion-ordered, the oldest evicted past `size`, expired on read."""

    def __init__(self, size: int, ttl_s: float):
        self.size, self.ttl_s = size, ttl_s
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()

    async def put(self, rid: str, record: dict) -> None:
        self._items[rid] = (time.monotonic() + self.ttl_s, json.dumps(record))
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    async def get(self, rid: str) -> dict | None:
        item = self._items.get(rid)
        if item is None:
            return None
        if item[0] < time.monotonic():
            del self._items[rid]
            return None
        return json.loads(item[1])

    async def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None

    async def close(self) -> None:
        self._items.clear()


@contextlib.contextmanager
def _reachable(url: str) -> Iterator[None]:
    """A Redis that cannot be reached is the service's problem, not the client's: a 503."""
    import redis

    try:
        yield
    except (redis.RedisError, OSError) as e:
        raise APIError(503, f"the response store (Redis at {url}) is unavailable: {e}",
                       code="store_unavailable") from None


class RedisStore:
    """One key per record (expiring after the TTL) and an index of ids by age for the size bound, so
    several gateways on one Redis share their responses."""

    def __init__(self, url: str, size: int, ttl_s: float):
        import redis.asyncio as aioredis  # imported here: no client library work at module import

        self.url, self.size, self.ttl_s = url, size, ttl_s
        self._client = aioredis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)

    async def put(self, rid: str, record: dict) -> None:
        with _reachable(self.url):
            await self._put(rid, record)

    async def _put(self, rid: str, record: dict) -> None:
        now = time.time()
        async with self._client.pipeline(transaction=True) as p:
            p.set(_PREFIX + rid, json.dumps(record), ex=max(1, int(self.ttl_s)))
            p.zadd(_INDEX, {rid: now})
            p.zremrangebyscore(_INDEX, "-inf", now - self.ttl_s)   # expired keys leave the index
            p.zcard(_INDEX)
            *_, count = await p.execute()
        if count > self.size:
            evicted = await self._client.zpopmin(_INDEX, count - self.size)
            if evicted:
                await self._client.delete(*(_PREFIX + k.decode() for k, _ in evicted))

    async def get(self, rid: str) -> dict | None:
        with _reachable(self.url):
            raw = await self._client.get(_PREFIX + rid)
        return None if raw is None else json.loads(raw)

    async def delete(self, rid: str) -> bool:
        with _reachable(self.url):
            async with self._client.pipeline(transaction=True) as p:
                p.delete(_PREFIX + rid)
                p.zrem(_INDEX, rid)
                removed, _ = await p.execute()
        return bool(removed)

    async def close(self) -> None:
        await self._client.aclose()


def open_store(config: GatewayConfig) -> ResponseStore:
    if config.redis_url:
        return RedisStore(config.redis_url, config.response_store_size, config.response_store_ttl_s)
    return MemoryStore(config.response_store_size, config.response_store_ttl_s)
