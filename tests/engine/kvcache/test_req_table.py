from __future__ import annotations

import pytest

from tandem.engine.kvcache.req_table import ReqToPageTable


def test_slots_alloc_lowest_first_until_exhausted():
    t = ReqToPageTable(3)
    assert (t.num_total_slots, t.num_free_slots) == (3, 3)
    assert [t.alloc_slot() for _ in range(3)] == [0, 1, 2]
    assert t.alloc_slot() is None
    assert t.num_free_slots == 0


def test_page_lists_set_append_and_clear_on_free():
    t = ReqToPageTable(2)
    s = t.alloc_slot()
    assert t.pages(s) == []
    t.set_pages(s, [4, 5])
    t.append_pages(s, [9])
    assert t.pages(s) == [4, 5, 9]
    t.free_slot(s)
    s2 = t.alloc_slot()
    assert s2 == s
    assert t.pages(s2) == []  # a reused slot starts empty


def test_set_pages_copies_the_callers_list():
    t = ReqToPageTable(1)
    s = t.alloc_slot()
    mine = [1, 2]
    t.set_pages(s, mine)
    mine.append(3)
    assert t.pages(s) == [1, 2]


def test_double_free_and_access_to_free_slot_raise():
    t = ReqToPageTable(2)
    s = t.alloc_slot()
    t.free_slot(s)
    with pytest.raises(AssertionError, match="not in use"):
        t.free_slot(s)
    with pytest.raises(AssertionError):
        t.pages(s)
    with pytest.raises(AssertionError):
        t.append_pages(s, [1])
    with pytest.raises(AssertionError):
        t.free_slot(7)
    assert t.num_free_slots == 2


def test_check_all_free_reports_leaked_slots():
    t = ReqToPageTable(4)
    t.check_all_free()
    t.alloc_slot()
    s = t.alloc_slot()
    with pytest.raises(AssertionError, match=r"2 of 4 in use: \[0, 1\]"):
        t.check_all_free()
    t.free_slot(0)
    t.free_slot(s)
    t.check_all_free()
