import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tandem.kvtransfer.protocol.runs import expand_runs, merge_runs, split_runs


def test_merges_where_both_sides_are_consecutive():
    assert merge_runs([3, 4, 5, 9, 10, 2], [7, 8, 9, 1, 3, 4]) == [(3, 7, 3), (9, 1, 1), (10, 3, 1), (2, 4, 1)]
    assert merge_runs([], []) == []
    assert merge_runs([5], [0]) == [(5, 0, 1)]


def test_lengths_must_match():
    import pytest

    with pytest.raises(ValueError):
        merge_runs([1, 2], [1])


pairs = st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60)


@given(pairs)
def test_expanding_runs_gives_back_the_pairs(ps):
    src, dst = [s for s, _ in ps], [d for _, d in ps]
    runs = merge_runs(src, dst)
    assert expand_runs(runs) == (src, dst)
    assert all(n >= 1 for _, _, n in runs)
    # Maximal: two neighbouring runs could not have been one.
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:], strict=False):
        assert not (s1 == s0 + n0 and d1 == d0 + n0)


@given(st.integers(0, 100), st.integers(0, 100), st.integers(1, 50))
def test_one_consecutive_stretch_is_one_run(s, d, n):
    assert merge_runs(list(range(s, s + n)), list(range(d, d + n))) == [(s, d, n)]


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000), st.integers(1, 30)), max_size=20),
       st.integers(1, 17))
def test_split_pieces_hold_at_most_max_pages_and_cover_the_runs(runs, max_pages):
    pieces = split_runs(np.array(runs, dtype=np.int64).reshape(-1, 3), max_pages)
    assert all(1 <= int(p[:, 2].sum()) <= max_pages for p in pieces)
    assert all(int(p[:, 2].sum()) == max_pages for p in pieces[:-1])     # only the last piece is short
    assert expand_runs([tuple(r) for p in pieces for r in p.tolist()]) == expand_runs(runs)
