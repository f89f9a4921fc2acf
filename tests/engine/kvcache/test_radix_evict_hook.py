"""RadixCache's eviction hook (torch-free): every evicted page is told once, with its token ids, its
page id and its key chain, before the page goes back to the allocator; keys are computed lazily and
kept aligned with the pages through splits and trims."""

from __future__ import annotations

from tandem.engine.kvcache.page_allocator import PageAllocator
from tandem.engine.kvcache.radix_cache import EvictedRun, RadixCache

PS = 2


def chain(parent, tokens):
    """A readable stand-in for block_hash: the whole prefix as a tuple."""
    return (parent or ()) + tuple(tokens)


class Recorder:
    def __init__(self, alloc: PageAllocator):
        self.alloc = alloc
        self.runs: list[EvictedRun] = []
        self.free_when_told: list[int] = []

    def __call__(self, run: EvictedRun) -> None:
        self.runs.append(run)
        self.free_when_told.append(self.alloc.num_free)

    def pages(self) -> list[int]:
        return [p for r in self.runs for p in r.pages]


def make(num_pages: int = 16, key_fn=chain):
    alloc = PageAllocator(num_pages)
    rec = Recorder(alloc)
    return alloc, RadixCache(alloc, PS, on_evict=rec, key_fn=key_fn), rec


def cache_seq(alloc, radix, tokens):
    pages = alloc.alloc(len(tokens) // PS)
    alloc.free(radix.insert(tokens, pages))
    return pages


def test_hook_sees_pages_tokens_and_keys_before_they_are_freed():
    alloc, radix, rec = make()
    pages = cache_seq(alloc, radix, [1, 2, 3, 4, 5, 6])
    free_before = alloc.num_free
    assert radix.evict(3) == 3
    [run] = rec.runs
    assert run.pages == pages
    assert run.page_tokens == [(1, 2), (3, 4), (5, 6)]
    assert run.keys == [(1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6)]
    assert run.parent is None
    assert rec.free_when_told == [free_before]   # told before the pages went back
    assert alloc.num_free == free_before + 3
    radix.check_consistency()


def test_trim_tells_only_the_tail_with_its_parent_key():
    alloc, radix, rec = make()
    pages = cache_seq(alloc, radix, [1, 2, 3, 4, 5, 6, 7, 8])
    assert radix.evict(1) == 1
    assert rec.runs[-1].pages == pages[3:] and rec.runs[-1].page_tokens == [(7, 8)]
    assert rec.runs[-1].parent == (1, 2, 3, 4, 5, 6) and rec.runs[-1].keys == [(1, 2, 3, 4, 5, 6, 7, 8)]
    assert radix.evict(2) == 2
    assert rec.runs[-1].pages == pages[1:3] and rec.runs[-1].parent == (1, 2)
    assert rec.runs[-1].keys == [(1, 2, 3, 4), (1, 2, 3, 4, 5, 6)]
    radix.check_consistency()


def test_keys_follow_splits_and_cascading_parents():
    alloc, radix, rec = make()
    shared = cache_seq(alloc, radix, [1, 2, 3, 4])
    a = cache_seq(alloc, radix, [1, 2, 3, 4, 5, 6])[2:]     # a child under the shared pages
    b = cache_seq(alloc, radix, [1, 2, 9, 9])[1:]            # splits the shared edge after one page
    assert radix.evict(10) == 4
    told = {p: (k, r.parent) for r in rec.runs for p, k in zip(r.pages, r.keys, strict=True)}
    assert sorted(told) == sorted(shared + a + b)
    assert told[a[0]] == ((1, 2, 3, 4, 5, 6), (1, 2, 3, 4))
    assert told[b[0]] == ((1, 2, 9, 9), (1, 2))
    assert told[shared[0]][0] == (1, 2) and told[shared[1]][0] == (1, 2, 3, 4)
    assert len(rec.pages()) == len(set(rec.pages())) == 4   # each page told once
    assert alloc.num_free == alloc.num_total
    radix.check_consistency()


def test_keys_are_computed_once_per_page():
    calls = []

    def counting(parent, tokens):
        calls.append(tuple(tokens))
        return chain(parent, tokens)

    alloc, radix, rec = make(key_fn=counting)
    cache_seq(alloc, radix, [1, 2, 3, 4, 5, 6])
    radix.evict(1)
    radix.evict(1)
    assert calls == [(1, 2), (3, 4), (5, 6)]   # the second trim reuses the node's keys
    assert [r.keys for r in rec.runs] == [[(1, 2, 3, 4, 5, 6)], [(1, 2, 3, 4)]]


def test_locked_pages_are_not_told_and_without_key_fn_keys_are_none():
    alloc, radix, rec = make(key_fn=None)
    cache_seq(alloc, radix, [1, 2, 3, 4])
    m = radix.match_prefix([1, 2, 3, 4])
    radix.lock(m.node)
    assert radix.evict(5) == 0 and rec.runs == []
    radix.unlock(m.node)
    assert radix.evict(5) == 2
    assert rec.runs[0].keys is None and rec.runs[0].parent is None


def test_no_hook_no_keys():
    alloc = PageAllocator(8)
    radix = RadixCache(alloc, PS)
    pages = cache_seq(alloc, radix, [1, 2, 3, 4])
    assert radix.evict(2) == 2 and alloc.num_free == 8
    assert all(n.page_keys is None for n in [radix.match_prefix([1, 2]).node]) and pages


def test_insert_hook_hears_only_new_pages_with_their_parent_key_and_reset_tells_every_page():
    alloc, radix, rec = make()
    told = []
    radix.on_insert = lambda keys, parent, pages: told.append((keys, parent))
    cache_seq(alloc, radix, [1, 2, 3, 4])
    cache_seq(alloc, radix, [1, 2, 3, 4, 5, 6])    # the first two pages are held already
    assert told == [([(1, 2), (1, 2, 3, 4)], None), ([(1, 2, 3, 4, 5, 6)], (1, 2, 3, 4))]
    assert sorted(radix.page_keys()) == [((1, 2), None), ((1, 2, 3, 4), (1, 2)), ((1, 2, 3, 4, 5, 6), (1, 2, 3, 4))]
    radix.reset()
    assert sorted(k for r in rec.runs for k in r.keys) == [(1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6)]
    assert alloc.num_free == 16 and radix.total_pages == 0
