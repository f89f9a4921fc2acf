"""KVManager with a request's PrefixSource (torch-free): admission fetches the pages past the L1 match
that the source holds (never the last token's page, never past what it holds), the fetched pages join
the prefix cache and count as cached and computed, a failed fetch leaves them to be recomputed, an
abort mid-fetch cancels it, and every page comes back (check_idle). The source here is a test double
of another worker's pool; the real one (services/prefill/kv_fetch.py) is tested over real transfers
in tests/services/test_pd_kv_reuse.py."""

from __future__ import annotations

import threading

from tandem.engine.kvcache.kv_manager import KVManager
from tandem.engine.kvcache.tiers.link import LoadJob
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.request import Request

PS = 4


class PeerPool:
    """Another worker's pool holding the first `tokens` tokens of a prompt; `start_load` writes page
    contents into `mem` of this worker (on a thread, as a transfer lands) when released by `go`."""

    def __init__(self, tokens: int, mem: dict[int, tuple[int, ...]], prompt: list[int], fail: bool = False):
        self.tokens, self.mem, self.prompt, self.fail = tokens, mem, prompt, fail
        self.calls: list[tuple[int, int, list[int]]] = []
        self.go = threading.Event()
        self.cancelled: list[LoadJob] = []

    def start_load(self, first: int, last: int, pages) -> LoadJob:
        job = LoadJob(keys=[], pages=list(pages))
        self.calls.append((first, last, list(pages)))

        def land() -> None:
            self.go.wait(5.0)
            if not job.cancelled and not self.fail:
                for i, page in enumerate(job.pages):
                    self.mem[page] = tuple(self.prompt[(first + i) * PS:(first + i + 1) * PS])
                job.loaded = len(job.pages)
            job.done.set()

        threading.Thread(target=land, daemon=True).start()
        return job

    def cancel(self, job: LoadJob) -> None:
        job.cancelled = True
        self.go.set()
        job.done.wait()
        self.cancelled.append(job)


def finish(kv: KVManager, req: Request) -> None:
    while kv.is_loading(req):
        kv.wait_loads(5.0)
        kv.poll_loads()


PROMPT = list(range(100, 127))   # 6 full pages + 3 tokens


def test_fetches_the_pages_past_the_l1_match_and_caches_them():
    kv, mem = KVManager(16, PS, max_slots=2), {}
    first = Request("turn1", PROMPT[:9], SamplingParams(max_tokens=1))   # caches pages 0-1 on this worker
    assert kv.admit(first, first.all_ids)
    first.num_computed = 9
    kv.release(first)
    source = PeerPool(20, mem, PROMPT)                                    # the peer holds 5 pages
    req = Request("turn2", PROMPT, SamplingParams(max_tokens=1), kv_source=source)
    assert kv.admit(req, req.all_ids)
    assert kv.is_loading(req) and req.cache_len == 8
    assert source.calls == [(2, 5, req.pages[2:5])]                       # pages 2-4 only
    source.go.set()
    finish(kv, req)
    assert req.cache_len == req.num_computed == 20 and req.fetched_tokens == 12 and kv.num_fetched_pages == 3
    assert [mem[p] for p in req.pages[2:5]] == [tuple(PROMPT[i * PS:(i + 1) * PS]) for i in range(2, 5)]
    req.num_computed = len(PROMPT)
    kv.release(req)
    again = Request("turn2-again", PROMPT, SamplingParams(max_tokens=1))
    assert kv.prefix_match_len(again.all_ids) == 24                       # fetched pages are cached here now
    kv.check_idle()


def test_never_fetches_the_page_of_the_last_token():
    kv, mem = KVManager(16, PS, max_slots=1), {}
    prompt = PROMPT[:24]                                                  # 6 full pages exactly
    source = PeerPool(24, mem, prompt)
    req = Request("r", prompt, SamplingParams(max_tokens=1), kv_source=source)
    assert kv.admit(req, req.all_ids)
    assert source.calls[0][:2] == (0, 5)                                  # the last page is computed
    source.go.set()
    finish(kv, req)
    assert req.cache_len == 20
    kv.release(req)
    kv.check_idle()


def test_a_source_holding_no_more_than_the_match_is_not_asked():
    kv, mem = KVManager(16, PS, max_slots=2), {}
    first = Request("a", PROMPT, SamplingParams(max_tokens=1))
    assert kv.admit(first, first.all_ids)
    first.num_computed = len(PROMPT)
    kv.release(first)
    source = PeerPool(16, mem, PROMPT)
    req = Request("b", PROMPT, SamplingParams(max_tokens=1), kv_source=source)
    assert kv.admit(req, req.all_ids)
    assert not kv.is_loading(req) and source.calls == [] and req.cache_len == 24
    kv.release(req)
    kv.check_idle()


def test_a_failed_fetch_is_recomputed_and_leaks_nothing():
    kv, mem = KVManager(16, PS, max_slots=1), {}
    source = PeerPool(20, mem, PROMPT, fail=True)
    req = Request("r", PROMPT, SamplingParams(max_tokens=1), kv_source=source)
    assert kv.admit(req, req.all_ids)
    source.go.set()
    finish(kv, req)
    assert req.cache_len == req.num_computed == 0 and req.fetched_tokens == 0 and kv.num_fetched_pages == 0
    kv.release(req, [])
    kv.check_idle()


def test_release_mid_fetch_cancels_it_first():
    kv, mem = KVManager(16, PS, max_slots=1), {}
    source = PeerPool(20, mem, PROMPT)
    req = Request("r", PROMPT, SamplingParams(max_tokens=1), kv_source=source)
    assert kv.admit(req, req.all_ids)
    kv.release(req, [])                                                   # the client went away
    assert len(source.cancelled) == 1 and mem == {}                       # nothing landed after the release
    assert kv.num_loading == 0
    kv.check_idle()
