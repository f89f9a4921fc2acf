from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.engine.kvcache.page_allocator import PageAllocator


def test_fresh_pool_hands_out_lowest_ids_in_order():
    a = PageAllocator(8)
    assert (a.num_total, a.num_free) == (8, 8)
    assert a.alloc(3) == [0, 1, 2]
    assert a.alloc(2) == [3, 4]
    assert a.num_free == 3


def test_alloc_zero_and_all_or_nothing():
    a = PageAllocator(4)
    assert a.alloc(0) == []
    held = a.alloc(3)
    assert a.alloc(2) is None
    assert a.num_free == 1  # the failed call took nothing
    assert a.alloc(1) == [3]
    assert a.alloc(1) is None
    a.free(held)
    assert a.num_free == 3


def test_negative_alloc_is_a_caller_error():
    with pytest.raises(ValueError):
        PageAllocator(4).alloc(-1)


def test_freed_pages_are_recycled_sorted_once_fresh_ones_run_out():
    a = PageAllocator(6)
    first = a.alloc(4)
    a.free([first[3], first[0], first[2]])  # 3, 0, 2 returned out of order
    assert a.alloc(2) == [4, 5]  # untouched pages first: no sort on the free path
    assert a.alloc(3) == [0, 2, 3]  # then the freed ones, merged into one ascending run
    assert a.num_free == 0


def test_double_free_and_bad_ids_raise_and_change_nothing():
    a = PageAllocator(4)
    pages = a.alloc(2)
    a.free([pages[0]])
    with pytest.raises(AssertionError, match="double free"):
        a.free([pages[0]])
    with pytest.raises(AssertionError, match="out of range"):
        a.free([4])
    with pytest.raises(AssertionError, match="out of range"):
        a.free([-1])
    with pytest.raises(AssertionError, match="twice"):
        a.free([pages[1], pages[1]])
    assert a.num_free == 3
    assert not a.is_free(pages[1])
    a.check_consistency()


def test_check_all_free_names_leaked_pages_and_reset_clears():
    a = PageAllocator(5)
    a.check_all_free()
    a.alloc(2)
    with pytest.raises(AssertionError, match=r"2 of 5 pages still allocated \(ids: 0, 1\)"):
        a.check_all_free()
    a.reset()
    a.check_all_free()
    assert a.alloc(5) == [0, 1, 2, 3, 4]


def test_empty_pool():
    a = PageAllocator(0)
    assert a.alloc(0) == []
    assert a.alloc(1) is None
    a.check_all_free()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 10)),
        st.tuples(st.just("free"), st.integers(0, 2**16), st.integers(1, 10)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(0, 16), ops=ops)
def test_random_alloc_free_matches_a_set_model(num_pages, ops):
    a = PageAllocator(num_pages)
    held: list[int] = []
    for op in ops:
        if op[0] == "alloc":
            n = op[1]
            got = a.alloc(n)
            if n > num_pages - len(held):
                assert got is None
            else:
                assert got is not None and len(got) == n
                assert got == sorted(got)
                assert set(got).isdisjoint(held)
                assert all(0 <= p < num_pages for p in got)
                held.extend(got)
        elif held:
            start = op[1] % len(held)
            chunk = held[start : start + op[2]]
            del held[start : start + op[2]]
            a.free(chunk)
        assert a.num_free + len(held) == num_pages
        assert len(set(held)) == len(held)
        assert all(not a.is_free(p) for p in held)
        a.check_consistency()
    a.free(held)
    a.check_all_free()
    assert a.alloc(num_pages) == list(range(num_pages))
