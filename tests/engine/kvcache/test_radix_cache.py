from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.kvcache.page_allocator import PageAllocator
from tandem.engine.kvcache.radix_cache import PrefixMatch, RadixCache, RadixNode


def make(num_pages: int = 16, page_size: int = 2, enabled: bool = True):
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, page_size, enabled=enabled)


def cache_seq(alloc: PageAllocator, radix: RadixCache, tokens: list[int]) -> list[int]:
    """Insert `tokens` (whole pages) with fresh pages, freeing duplicates as a request would."""
    pages = alloc.alloc(len(tokens) // radix.page_size)
    alloc.free(radix.insert(tokens, pages))
    return pages


def test_empty_cache_matches_nothing():
    _, radix = make()
    m = radix.match_prefix([1, 2, 3, 4])
    assert isinstance(m, PrefixMatch)
    assert (m.pages, m.num_tokens) == ([], 0)
    assert isinstance(m.node, RadixNode)
    radix.lock(m.node)  # locking the root is harmless
    radix.unlock(m.node)


def test_match_whole_pages_only_ignores_trailing_partial_page():
    alloc, radix = make(page_size=2)
    pages = cache_seq(alloc, radix, [1, 2, 3, 4])
    assert radix.match_prefix([1, 2, 3, 4]).pages == pages
    m = radix.match_prefix([1, 2, 3])  # the second page is incomplete in the query
    assert (m.pages, m.num_tokens) == (pages[:1], 2)
    assert radix.match_prefix([1, 9, 3, 4]).pages == []  # differs inside the first page
    assert radix.match_prefix([1, 2, 3, 4, 5, 6]).num_tokens == 4
    radix.check_consistency()


def test_match_ending_inside_an_edge_splits_it_at_the_page_boundary():
    alloc, radix = make(page_size=2)
    pages = cache_seq(alloc, radix, [1, 2, 3, 4, 5, 6])  # one edge of three pages
    m = radix.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.pages == pages[:2]
    assert m.node.pages == pages[:2]  # the node covers exactly the matched pages
    radix.check_consistency()
    # Locking the split node protects its two pages but not the tail edge.
    radix.lock(m.node)
    assert (radix.protected_pages, radix.evictable_pages) == (2, 1)
    assert radix.evict(10) == 1
    assert radix.match_prefix([1, 2, 3, 4, 5, 6]).pages == pages[:2]
    radix.unlock(m.node)
    assert radix.evict(10) == 2
    alloc.check_all_free()


def test_insert_returns_pages_cached_under_other_ids():
    alloc, radix = make(page_size=2)
    first = cache_seq(alloc, radix, [1, 2, 3, 4])
    second = alloc.alloc(3)
    dup = radix.insert([1, 2, 3, 4, 5, 6], second)
    assert dup == second[:2]  # first two chunks already cached under `first`
    alloc.free(dup)
    assert radix.match_prefix([1, 2, 3, 4, 5, 6]).pages == first + second[2:]
    assert radix.total_pages == 3
    radix.check_consistency()


def test_insert_diverging_inside_an_edge_splits_and_takes_the_new_tail():
    alloc, radix = make(page_size=1)
    a = cache_seq(alloc, radix, [1, 2, 3])
    b = alloc.alloc(3)
    assert radix.insert([1, 2, 7], b) == b[:2]
    alloc.free(b[:2])
    assert radix.match_prefix([1, 2, 7]).pages == a[:2] + b[2:]
    assert radix.match_prefix([1, 2, 3]).pages == a
    radix.check_consistency()


def test_reinserting_matched_pages_returns_nothing():
    alloc, radix = make(page_size=2)
    cached = cache_seq(alloc, radix, [1, 2, 3, 4])
    m = radix.match_prefix([1, 2, 3, 4, 5, 6, 7])
    radix.lock(m.node)
    own = alloc.alloc(2)  # one full page [5, 6] and one partial page [7]
    dup = radix.insert([1, 2, 3, 4, 5, 6], m.pages + own[:1])
    assert dup == []
    alloc.free(own[1:])
    radix.unlock(m.node)
    assert radix.match_prefix([1, 2, 3, 4, 5, 6]).pages == cached + own[:1]
    assert radix.total_pages == alloc.num_total - alloc.num_free == 3


def test_insert_requires_whole_pages():
    _, radix = make(page_size=2)
    with pytest.raises(ValueError, match="whole pages"):
        radix.insert([1, 2, 3], [0, 1])
    with pytest.raises(ValueError):
        radix.insert([1, 2], [0, 1])


def test_evict_least_recently_used_leaf_first():
    alloc, radix = make(page_size=1)
    a = cache_seq(alloc, radix, [1])
    b = cache_seq(alloc, radix, [2])
    c = cache_seq(alloc, radix, [3])
    radix.match_prefix([1])  # `a` is now the most recently used
    assert radix.evict(1) == 1
    assert not alloc.is_free(a[0]) and alloc.is_free(b[0]) and not alloc.is_free(c[0])
    assert radix.evict(1) == 1
    assert alloc.is_free(c[0]) and not alloc.is_free(a[0])
    assert radix.match_prefix([1]).pages == a


def test_insert_refreshes_lru_too():
    alloc, radix = make(page_size=1)
    a = cache_seq(alloc, radix, [1])
    b = cache_seq(alloc, radix, [2])
    alloc.free(radix.insert([1], alloc.alloc(1)))  # touches `a` via a duplicate insert
    radix.evict(1)
    assert alloc.is_free(b[0]) and not alloc.is_free(a[0])


def test_evict_trims_a_long_leaf_from_its_tail():
    alloc, radix = make(page_size=2)
    pages = cache_seq(alloc, radix, [0, 1, 2, 3, 4, 5, 6, 7])
    assert radix.evict(1) == 1
    assert alloc.is_free(pages[3])
    assert radix.match_prefix([0, 1, 2, 3, 4, 5, 6, 7]).pages == pages[:3]
    radix.check_consistency()


def test_evict_cascades_to_parent_after_its_last_child():
    alloc, radix = make(page_size=2)
    parent = cache_seq(alloc, radix, [0, 0])
    child = cache_seq(alloc, radix, [0, 0, 1, 1])[1:]  # parent page comes back as a duplicate
    newer = cache_seq(alloc, radix, [2, 2])
    # The parent is older than `newer` but must wait for its child; then it goes before `newer`.
    assert radix.evict(2) == 2
    assert alloc.is_free(child[0]) and alloc.is_free(parent[0])
    assert not alloc.is_free(newer[0])
    assert radix.match_prefix([0, 0]).pages == []
    assert radix.match_prefix([2, 2]).pages == newer
    radix.check_consistency()


def test_locked_path_is_never_evicted_and_unlock_below_zero_raises():
    alloc, radix = make(page_size=1)
    a = cache_seq(alloc, radix, [1, 2])
    b = cache_seq(alloc, radix, [3])
    m = radix.match_prefix([1, 2])
    radix.lock(m.node)
    radix.lock(m.node)  # locks are counted
    assert (radix.protected_pages, radix.evictable_pages, radix.total_pages) == (2, 1, 3)
    assert radix.evict(10) == 1
    assert alloc.is_free(b[0])
    radix.unlock(m.node)
    assert radix.evict(10) == 0
    radix.unlock(m.node)
    with pytest.raises(AssertionError, match="unlock"):
        radix.unlock(m.node)
    assert radix.evictable_pages == 2
    assert radix.evict(10) == 2
    assert all(alloc.is_free(p) for p in a)
    alloc.check_all_free()


def test_lock_survives_a_later_split_of_the_locked_edge():
    alloc, radix = make(page_size=1)
    pages = cache_seq(alloc, radix, [1, 2, 3])
    m = radix.match_prefix([1, 2, 3])
    radix.lock(m.node)
    radix.match_prefix([1, 9])  # splits the locked edge after its first page
    radix.check_consistency()
    assert radix.protected_pages == 3
    assert radix.evict(10) == 0
    radix.unlock(m.node)
    assert radix.evictable_pages == 3
    assert radix.evict(10) == 3
    assert all(alloc.is_free(p) for p in pages)


def test_reset_frees_everything_but_refuses_while_locked():
    alloc, radix = make(page_size=2)
    cache_seq(alloc, radix, [1, 2, 3, 4])
    cache_seq(alloc, radix, [1, 2, 5, 6])
    m = radix.match_prefix([1, 2])
    radix.lock(m.node)
    with pytest.raises(AssertionError, match="locked"):
        radix.reset()
    radix.unlock(m.node)
    radix.reset()
    assert radix.total_pages == 0
    alloc.check_all_free()
    assert radix.match_prefix([1, 2, 3, 4]).pages == []


def test_disabled_cache_matches_nothing_and_returns_every_page():
    alloc, radix = make(page_size=2, enabled=False)
    pages = alloc.alloc(2)
    assert radix.insert([1, 2, 3, 4], pages) == pages
    alloc.free(pages)
    assert radix.match_prefix([1, 2, 3, 4]).pages == []
    assert radix.evict(5) == 0
    assert radix.total_pages == 0
    alloc.check_all_free()


# ---- property test: requests sharing prefixes against a dict model of the tree -----------------


@dataclass
class Req:
    tokens: list[int]
    match: PrefixMatch
    own: list[int]  # pages this request allocated (not in the tree)


# Each op is (kind, shared, tail, n). A start's tokens are base[:shared] + tail with one base
# prompt per example, so requests share long prefixes (locked leaves, splits inside locked edges)
# as real traffic does. `n` picks the request to finish/abort, or is the evict amount. Starts and
# finishes are weighted up: prefixes only get cached, and then matched, after a finish.
ops_st = st.lists(
    st.tuples(
        st.sampled_from(["start", "start", "start", "finish", "finish", "abort", "evict"]),
        st.integers(0, 12),
        st.lists(st.integers(0, 3), max_size=6),
        st.integers(0, 12),
    ),
    min_size=20,
    max_size=50,
)


@settings(max_examples=200, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    num_pages=st.integers(3, 24),
    enabled=st.booleans(),
    base=st.lists(st.integers(0, 3), min_size=12, max_size=12),
    ops=ops_st,
)
def test_random_requests_keep_every_page_accounted_for(page_size, num_pages, enabled, base, ops):
    ps = page_size
    alloc = PageAllocator(num_pages)
    radix = RadixCache(alloc, ps, enabled=enabled)
    # Model of the tree: every cached whole-page prefix -> the page holding its last chunk.
    model: dict[tuple[int, ...], int] = {}
    live: list[Req] = []

    def expected_match(tokens: list[int]) -> list[int]:
        out = []
        for i in range(len(tokens) // ps):
            page = model.get(tuple(tokens[: (i + 1) * ps]))
            if page is None:
                break
            out.append(page)
        return out

    def check() -> None:
        radix.check_consistency()
        alloc.check_consistency()
        tree = radix.cached_pages()
        owned = [p for r in live for p in r.own]
        everywhere = tree + owned
        assert len(set(everywhere)) == len(everywhere), "a page is held twice"
        assert not any(alloc.is_free(p) for p in everywhere)
        assert alloc.num_free + radix.total_pages + len(owned) == num_pages
        assert set(tree) == set(model.values())
        locked = {p for r in live for p in r.match.pages}
        assert radix.protected_pages == len(locked)
        # The model stays prefix-closed: eviction only ever removes leaves.
        assert all(k[:-ps] in model for k in model if len(k) > ps)

    def forget_evicted() -> None:
        tree = set(radix.cached_pages())
        for key in [k for k, p in model.items() if p not in tree]:
            del model[key]
        # Pages locked by live requests are never evicted.
        assert all(p in tree for r in live for p in r.match.pages)

    def finish(req: Req, cache_it: bool) -> None:
        if cache_it:
            full = len(req.tokens) // ps
            pages = req.match.pages + req.own
            expected_dups = []
            for i in range(full):
                key = tuple(req.tokens[: (i + 1) * ps])
                if key in model:
                    if model[key] != pages[i]:
                        expected_dups.append(pages[i])
                elif enabled:
                    model[key] = pages[i]
            if not enabled:
                expected_dups = pages[:full]
            dups = radix.insert(req.tokens[: full * ps], pages[:full])
            assert dups == expected_dups
            # Free the duplicates and the trailing partial page; the tree owns the rest.
            alloc.free(dups + pages[full:])
        else:
            alloc.free(req.own)
        radix.unlock(req.match.node)

    for op in ops:
        kind, shared, tail, n = op
        if kind == "start":
            tokens = (base[:shared] + tail)[:12]
            m = radix.match_prefix(tokens)
            assert m.pages == expected_match(tokens)
            assert m.num_tokens == len(m.pages) * ps
            radix.lock(m.node)
            need = -(-len(tokens) // ps) - len(m.pages)
            own = alloc.alloc(need)
            if own is None:
                before, want = radix.evictable_pages, need - alloc.num_free
                assert radix.evict(want) == min(want, before)
                forget_evicted()
                own = alloc.alloc(need)
            if own is None:
                radix.unlock(m.node)  # the request cannot fit now: give everything back
            else:
                live.append(Req(tokens, m, own))
        elif kind in ("finish", "abort") and live:
            finish(live.pop(n % len(live)), cache_it=kind == "finish")
        elif kind == "evict":
            before = radix.evictable_pages
            assert radix.evict(n) == min(n, before)
            forget_evicted()
        check()

    while live:
        finish(live.pop(), cache_it=True)
        check()
    assert radix.protected_pages == 0
    cached = radix.total_pages
    assert radix.evict(num_pages) == cached
    alloc.check_all_free()
    assert radix.total_pages == 0


def test_namespaces_never_share_pages_and_start_key_chains_of_their_own():
    """KV of a LoRA adapter lives in its own namespace: the same tokens match only there, each namespace
    keeps its pages, eviction and locks work across them, and its keys chain from its root's key."""
    alloc = PageAllocator(16)
    inserted: list[tuple[list, object]] = []
    cache = RadixCache(alloc, 2, key_fn=lambda parent, page: (parent, tuple(page)),
                       on_insert=lambda keys, parent, pages: inserted.append((keys, parent)))
    tokens = [1, 2, 3, 4]
    base_pages, lora_pages = alloc.alloc(2), alloc.alloc(2)
    assert cache.insert(tokens, base_pages) == []
    assert cache.match_prefix(tokens, ns=b"A").num_tokens == 0          # the base model's pages are not A's
    assert cache.insert(tokens, lora_pages, ns=b"A") == []               # A keeps its own copy
    assert cache.match_prefix(tokens).pages == base_pages
    assert cache.match_prefix(tokens, ns=b"A").pages == lora_pages
    assert cache.match_prefix(tokens, ns=b"B").num_tokens == 0
    (base_keys, base_parent), (a_keys, a_parent) = inserted
    assert base_parent is None and a_parent == b"A" and a_keys[0] == (b"A", (1, 2)) != base_keys[0]
    m = cache.match_prefix(tokens, ns=b"A")
    cache.lock(m.node)
    assert cache.last_key(m.node) == a_keys[-1] and cache.last_key(cache.match_prefix([9], ns=b"A").node) == b"A"
    assert cache.evict(16) == 2 and cache.match_prefix(tokens).num_tokens == 0   # only the unlocked base pages
    assert cache.match_prefix(tokens, ns=b"A").pages == lora_pages
    cache.unlock(m.node)
    cache.check_consistency()
    assert sorted(cache.cached_pages()) == sorted(lora_pages)
    cache.reset()
    assert alloc.num_free == 16
