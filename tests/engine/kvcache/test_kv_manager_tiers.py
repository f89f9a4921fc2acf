"""KVManager with a TierLink (torch-free): evicted pages are demoted with the right keys, admission
loads the pages past the L1 match that the tiers hold into the request's pages and counts them as
computed, a block that vanished ends the run, and every page comes back (check_idle). Loads run on
the link's loader thread: a loading request waits for its own load while others are admitted and
released, and an abort or a close mid-load stops it after the page in progress and leaks nothing."""

from __future__ import annotations

import threading
import time

from tandem.engine.kvcache.kv_manager import KVManager
from tandem.engine.kvcache.tiers.disk import DiskTier
from tandem.engine.kvcache.tiers.host import HostTier
from tandem.engine.kvcache.tiers.link import TierLink
from tandem.engine.kvcache.tiers.store import TieredStore
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.request import Request
from tandem.kvblocks.blocks import Tier
from tandem.kvblocks.keys import Namespace, block_hashes

PS = 4
BLOCK = 8
NS = Namespace("test-model", "float32", PS, 1, 1, 1)


class FakePool:
    """Page id -> its bytes; 'computing' a page writes bytes derived from its tokens."""

    def __init__(self, num_pages: int):
        self.mem = {p: bytes(BLOCK) for p in range(num_pages)}
        self.writes: list[int] = []

    def read(self, page: int) -> bytes:
        return self.mem[page]

    def write(self, page: int, payload) -> None:
        self.mem[page] = bytes(payload)
        self.writes.append(page)


def content(tokens) -> bytes:
    return bytes(t % 256 for t in tokens) + bytes(BLOCK - PS)


def make(num_pages: int = 8, store: TieredStore | None = None):
    pool = FakePool(num_pages)
    store = store or TieredStore(HostTier(64 * BLOCK, BLOCK), None)
    kv = KVManager(num_pages, PS, max_slots=2, tiers=TierLink(store, NS, pool.read, pool.write))
    return kv, pool, store


def compute(kv: KVManager, pool: FakePool, req: Request) -> None:
    """What a prefill would do: fill every page past the cached ones, then mark all computed."""
    ids = req.all_ids
    for i in range(req.num_computed // PS, len(ids) // PS):
        pool.mem[req.pages[i]] = content(ids[i * PS:(i + 1) * PS])
    req.num_computed = len(ids)


def finish_load(kv: KVManager, req: Request) -> None:
    while kv.is_loading(req):
        kv.wait_loads(5.0)
        kv.poll_loads()


def serve(kv: KVManager, pool: FakePool, tokens: list[int]) -> Request:
    req = Request("r", tokens, SamplingParams(max_tokens=1))
    assert kv.admit(req, req.all_ids)
    finish_load(kv, req)
    loaded_ok = all(pool.mem[req.pages[i]] == content(tokens[i * PS:(i + 1) * PS])
                    for i in range(req.num_computed // PS))
    assert loaded_ok, "a cached or loaded page does not hold its tokens' KV"
    compute(kv, pool, req)
    kv.release(req)
    return req


A = list(range(100, 125))   # 6 full pages + 1 token
B = list(range(200, 229))   # 7 full pages + 1: evicts all of A from 8 pages


def test_evicted_pages_are_demoted_and_loaded_back():
    kv, pool, store = make()
    serve(kv, pool, A)
    serve(kv, pool, B)
    keys = block_hashes(NS, A[:24])
    assert [store.host.contains(k) for k in keys] == [True] * 6
    assert bytes(store.host.get(keys[2])) == content(A[8:12])
    req = serve(kv, pool, A)
    assert req.cache_len == 24 and kv.num_loaded_pages == 6   # all six loaded, only the last token computed
    assert store.stats().tier(Tier.HOST).hits == 6
    kv.check_idle()
    kv.cache.check_consistency()


def test_l1_match_then_tiers_for_the_rest():
    kv, pool, store = make(num_pages=10)
    serve(kv, pool, A)
    # Leaves A's first pages in L1: B needs 8 of 10 pages, so 4 of A's 6 full pages go.
    serve(kv, pool, B)
    l1 = kv.cache.match_prefix(A[:-1]).num_tokens
    assert 0 < l1 < 24
    req = serve(kv, pool, A)
    assert req.cache_len == 24 and kv.num_loaded_pages == (24 - l1) // PS
    kv.check_idle()


def test_a_block_gone_at_load_ends_the_run():
    class Flaky(TieredStore):
        def lookup(self, keys):
            found = super().lookup(keys)
            if len(found) == 6:   # A's six blocks all there: the fourth goes between lookup and load
                self.host.discard(keys[3])
            return found

    kv, pool, store = make(store=Flaky(HostTier(64 * BLOCK, BLOCK), None))
    serve(kv, pool, A)
    serve(kv, pool, B)
    req = serve(kv, pool, A)
    assert req.cache_len == 12 and kv.num_loaded_pages == 3   # pages 0-2 loaded, 3-5 recomputed
    assert store.stats().misses == 1
    kv.check_idle()


def test_failed_admission_loads_nothing_and_holds_nothing():
    kv, pool, store = make()
    serve(kv, pool, A)
    serve(kv, pool, B)
    holder = Request("h", list(range(300, 305)), SamplingParams(max_tokens=1))
    assert kv.admit(holder, holder.all_ids)   # 2 pages held: A's 7 no longer fit
    pool.writes.clear()
    big = Request("a", A, SamplingParams(max_tokens=1))
    assert not kv.admit(big, big.all_ids)
    assert big.slot is None and big.pages == [] and pool.writes == [] and kv.num_loaded_pages == 0
    kv.release(holder)
    kv.check_idle()


def test_without_tiers_nothing_is_hashed_or_demoted():
    kv = KVManager(8, PS, max_slots=2)
    assert kv.tiers is None and kv.cache.on_evict is None and kv.cache.key_fn is None


def test_a_failing_page_write_ends_the_run_and_leaks_nothing():
    kv, pool, store = make()
    serve(kv, pool, A)
    serve(kv, pool, B)
    real = pool.write

    def flaky(page, payload):
        if len(pool.writes) == 2:
            raise RuntimeError("device copy failed")
        real(page, payload)

    pool.write = kv.tiers.write_page = flaky
    req = serve(kv, pool, A)
    assert req.cache_len == 8 and kv.num_loaded_pages == 2 and kv.tiers.failures == 1
    kv.check_idle()
    kv.cache.check_consistency()


def test_a_failing_page_read_still_evicts():
    kv, pool, store = make()
    serve(kv, pool, A)

    def broken(page):
        raise RuntimeError("device copy failed")

    kv.tiers.read_page = broken
    serve(kv, pool, B)   # evicts A: nothing demoted, every page still freed
    assert len(store.host) == 0 and kv.tiers.failures == 1
    kv.check_idle()
    kv.cache.check_consistency()


def gated(pool: FakePool):
    """A page write that blocks until `gate` is set; `entered` is set when the first write starts."""
    gate, entered = threading.Event(), threading.Event()
    real = pool.write

    def write(page, payload):
        entered.set()
        assert gate.wait(10), "the test never opened the gate"
        real(page, payload)

    return write, gate, entered


def test_a_loading_request_waits_and_others_do_not(tmp_path):
    kv, pool, store = make(num_pages=12)
    serve(kv, pool, A)
    kv.cache.evict(kv.num_pages)   # all of A's pages to L2
    kv.tiers.write_page, gate, entered = gated(pool)
    req = Request("a", A, SamplingParams(max_tokens=1))
    assert kv.admit(req, req.all_ids)
    assert kv.is_loading(req) and req.cache_len == 0 and req.num_computed == 0
    assert entered.wait(5)
    assert kv.poll_loads() == [] and kv.is_loading(req)   # polling never waits
    other = serve(kv, pool, B[:9])   # another request is admitted, computed and released meanwhile
    assert other.slot is None
    gate.set()
    finish_load(kv, req)
    assert req.cache_len == 24 and req.num_computed == 24 and kv.num_loaded_pages == 6
    assert all(pool.mem[req.pages[i]] == content(A[i * PS:(i + 1) * PS]) for i in range(6))
    kv.release(req)
    kv.check_idle()
    kv.cache.check_consistency()


def test_abort_mid_load_cancels_frees_everything_and_leaves_no_temp_files(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20, NS)
    kv, pool, store = make(num_pages=12, store=TieredStore(None, disk))
    serve(kv, pool, A)
    kv.cache.evict(kv.num_pages)   # A's six pages to L3 (written behind)
    assert store.flush(5)
    kv.tiers.write_page, gate, entered = gated(pool)
    req = Request("a", A, SamplingParams(max_tokens=1))
    assert kv.admit(req, req.all_ids) and kv.is_loading(req)
    assert entered.wait(5)   # the loader is inside the first page's write
    aborting = threading.Thread(target=kv.release, args=(req,))
    aborting.start()
    aborting.join(0.2)
    assert aborting.is_alive(), "release must wait for the page in progress"
    gate.set()
    aborting.join(5)
    assert not aborting.is_alive()
    writes = list(pool.writes)
    assert writes == [writes[0]]   # stopped after the page in progress
    assert req.slot is None and req.pages == [] and not kv.is_loading(req)
    kv.check_idle()
    kv.cache.check_consistency()
    time.sleep(0.05)
    assert pool.writes == writes   # nothing written into the freed pages afterwards
    kv.tiers.close()
    kv.tiers.close()
    assert list(tmp_path.rglob("*.tmp")) == []
    assert len(list(tmp_path.rglob("*.kvb"))) == 6


def test_close_cancels_loads_in_flight():
    kv, pool, store = make(num_pages=12)
    serve(kv, pool, A)
    kv.cache.evict(kv.num_pages)
    kv.tiers.write_page, gate, entered = gated(pool)
    req = Request("a", A, SamplingParams(max_tokens=1))
    assert kv.admit(req, req.all_ids)
    assert entered.wait(5)
    threading.Timer(0.1, gate.set).start()
    kv.tiers.close()   # cancels the job, waits for its page in progress, closes the store
    assert len(pool.writes) == 1
    kv.release(req)
    kv.check_idle()
