"""The LRU bookkeeping of loaded adapters (engine/lora/pool.py): torch-free, microseconds."""

from __future__ import annotations

import pytest

from tandem.engine.errors import ResourceExhausted
from tandem.engine.lora.pool import AdapterPool


def test_room_means_no_eviction_and_a_loaded_adapter_needs_none():
    pool = AdapterPool(2)
    assert pool.evictions("a", ()) == []
    pool.add("a")
    assert pool.evictions("a", ()) == [] and pool.evictions("b", ()) == []


def test_the_least_recently_used_idle_adapter_goes_first():
    pool = AdapterPool(3)
    for n in "abc":
        pool.add(n)
    pool.touch("a")                              # order now b, c, a
    assert pool.names() == ["b", "c", "a"]
    assert pool.evictions("d", ()) == ["b"]
    assert pool.evictions("d", {"b"}) == ["c"]   # never one in use
    assert pool.evictions("d", {"b", "c"}) == ["a"]


def test_all_in_use_refuses_and_changes_nothing():
    pool = AdapterPool(2)
    pool.add("a")
    pool.add("b")
    with pytest.raises(ResourceExhausted, match="--max-cpu-loras 2"):
        pool.evictions("c", {"a", "b"})
    assert pool.names() == ["a", "b"]


def test_remove_frees_a_slot():
    pool = AdapterPool(1)
    pool.add("a")
    pool.remove("a")
    pool.remove("a")    # twice is fine
    assert len(pool) == 0 and pool.evictions("b", ()) == []
    pool.add("b")
    assert "b" in pool and "a" not in pool
