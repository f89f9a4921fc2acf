from __future__ import annotations

import pytest

from tandem.engine.kvcache.tiers.host import HostTier
from tandem.kvblocks.blocks import BlockMeta, Tier


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def block(i: int, n: int = 32) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def test_round_trip_and_capacity_in_whole_slots():
    h = HostTier(capacity_bytes=100, block_bytes=32)  # 3 slots; 4 spare bytes are not a slot
    assert (h.capacity_bytes, h.used_bytes, h.enabled) == (96, 0, True)
    assert h.put(key(1), None, block(1))
    assert bytes(h.get(key(1))) == block(1)
    assert h.contains(key(1)) and not h.contains(key(2))
    assert h.get(key(2)) is None
    assert h.used_bytes == 32
    assert h.meta(key(1)) == BlockMeta(key(1), None, Tier.HOST)


def test_lru_eviction_follows_use_not_insertion():
    evicted = []
    h = HostTier(96, 32, on_evict=lambda meta, view: evicted.append((meta.key, bytes(view))))
    for i in range(3):
        h.put(key(i), key(i - 1) if i else None, block(i))
    h.get(key(0))  # 1 is now the least recently used
    h.put(key(3), key(2), block(3))
    assert evicted == [(key(1), block(1))]  # the hook saw the evicted payload intact
    assert h.keys() == [key(2), key(0), key(3)]
    h.put(key(0), None, block(0))  # a repeat put touches
    h.put(key(4), key(3), block(4))
    assert evicted[-1][0] == key(2)
    assert h.evictions == 2 and len(h) == 3


def test_a_block_written_once_is_not_written_again():
    h = HostTier(96, 32)
    assert h.put(key(1), None, block(1))
    assert not h.put(key(1), None, block(9))  # same key: the bytes are not touched
    assert bytes(h.get(key(1))) == block(1)


def test_one_arena_no_allocation_per_put():
    buf = bytearray(64)
    h = HostTier(64, 32, buffer=buf)
    views = []
    for i in range(5):
        h.put(key(i), None, block(i))
        views.append(h.get(key(i)))
    assert all(v.obj is buf for v in views)  # every payload lives in the caller's arena
    assert bytes(buf[:32]) in (block(3), block(4)) and bytes(buf[32:]) in (block(3), block(4))


def test_short_payloads_and_caller_errors():
    h = HostTier(64, 32)
    h.put(key(1), None, b"abc")
    assert bytes(h.get(key(1))) == b"abc"
    with pytest.raises(ValueError, match="does not fit"):
        h.put(key(2), None, bytes(33))
    with pytest.raises(ValueError, match="--kv-host-cache-gb"):
        HostTier(31, 32)
    with pytest.raises(ValueError, match="writable"):
        HostTier(64, 32, buffer=bytes(64))


def test_discard_frees_the_slot_and_listener_hears_everything():
    events = []
    h = HostTier(64, 32, listener=lambda kind, meta: events.append((kind, meta.key)))
    h.put(key(1), None, block(1))
    h.put(key(2), key(1), block(2))
    assert h.discard(key(1)) and not h.discard(key(1))
    h.put(key(3), key(2), block(3))  # takes the freed slot: nothing evicted
    h.put(key(4), key(3), block(4))  # evicts 2
    assert events == [("stored", key(1)), ("stored", key(2)), ("removed", key(1)), ("stored", key(3)),
                      ("removed", key(2)), ("stored", key(4))]
    assert h.meta(key(4)).parent == key(3)


def test_a_failing_evict_hook_leaks_no_slot():
    def boom(meta, view):
        raise RuntimeError("hook failed")

    h = HostTier(32, 32, on_evict=boom)
    h.put(key(1), None, block(1))
    with pytest.raises(RuntimeError):
        h.put(key(2), None, block(2))
    h.on_evict = None
    assert h.put(key(3), None, block(3))
    assert bytes(h.get(key(3))) == block(3)


def test_close_is_safe_twice_and_turns_the_tier_off():
    h = HostTier(64, 32)
    h.put(key(1), None, block(1))
    view = h.get(key(1))
    h.close()
    h.close()
    assert not h.enabled
    assert h.get(key(1)) is None and not h.put(key(2), None, block(2)) and h.keys() == []
    assert bytes(view) == block(1)  # a view handed out earlier stays readable


def test_a_block_changed_in_memory_is_a_miss_dropped_and_counted():
    arena = bytearray(96)
    events = []
    h = HostTier(96, 32, buffer=arena, listener=lambda kind, meta: events.append((kind, meta.key)))
    h.put(key(1), None, block(1))
    h.put(key(2), None, block(2))
    arena[32 + 5] ^= 0x01                     # slot of key 2: one bit flipped behind the tier's back
    assert bytes(h.get(key(1))) == block(1)
    assert h.get(key(2)) is None and not h.contains(key(2)) and h.corrupt == 1
    assert events[-1] == ("removed", key(2)) and h.used_bytes == 32
    assert h.put(key(2), None, block(2)) and bytes(h.get(key(2))) == block(2)   # stored again, good again
