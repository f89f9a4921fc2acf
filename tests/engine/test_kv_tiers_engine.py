"""The KV tiers below the pool, end to end on the tiny fp32 model: a prompt whose prefix the pool
evicted gets the same greedy tokens whether its prefix is recomputed, loaded from L2 (host memory), or
loaded from L3 (disk, by a fresh engine on the same directory: a warm restart); a corrupt block file is
a miss and the prefix is recomputed; every page is back afterwards."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.errors import InvalidRequest
from tandem.engine.sampling_params import SamplingParams
from tandem.kvblocks.blocks import Tier

PS = 4
# 12 pages of 4 tokens: the pool holds one 40-token prompt and its output, not two.
POOL_TOKENS = 48
PREFIX = [(7 * i + 3) % 500 + 3 for i in range(36)]     # 9 full pages shared by the two turns
A = PREFIX + [11, 12, 13]
B = [(5 * i + 1) % 500 + 3 for i in range(42)]         # unrelated: fills the pool, evicting all of A
A2 = PREFIX + [21, 22, 23]                             # the next turn: A's prefix again
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def make(model: Path, **tiers) -> LLMEngine:
    tiers.setdefault("max_total_tokens", POOL_TOKENS)
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", page_size=PS, context_length=128,
                                  max_running_requests=2, **tiers))


def run_turns(engine: LLMEngine, prompts) -> list[list[int]]:
    out = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    engine.check_idle()
    return out


def served_from_tiers(engine: LLMEngine) -> int:
    return engine.scheduler.kv.num_loaded_pages


@pytest.fixture(scope="module")
def reference(tiny_llama) -> list[list[int]]:
    engine = make(tiny_llama)
    try:
        assert engine.kv_tiers is None
        out = run_turns(engine, [A, B, A2])
        assert served_from_tiers(engine) == 0
        return out
    finally:
        engine.close()


@pytest.mark.parametrize("with_disk", [False, True], ids=["l2", "l2+l3"])
def test_l2_hit_gives_the_same_tokens(tiny_llama, reference, tmp_path, with_disk):
    disk = dict(kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=0.01) if with_disk else {}
    # Overlap asked for: the engine turns it off, tier copies must not race a forward pass.
    engine = make(tiny_llama, kv_host_cache_gb=0.01, enable_overlap_schedule=True, **disk)
    try:
        assert not engine.overlap
        assert run_turns(engine, [A, B, A2]) == reference
        stats = engine.kv_tiers.store.stats()
        host = stats.tier(Tier.HOST)
        assert host.hits == 9 and host.bytes_read == 9 * engine.runner.pool.block_bytes
        assert (stats.tier(Tier.DISK) is None) != with_disk
        assert not with_disk or stats.tier(Tier.DISK).hits == 0   # L2 answered first
        assert served_from_tiers(engine) == 9
    finally:
        engine.close()
        engine.close()   # safe twice


def test_l3_warm_restart_gives_the_same_tokens(tiny_llama, reference, tmp_path):
    first = make(tiny_llama, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=0.01)
    try:
        assert run_turns(first, [A, B]) == reference[:2]
    finally:
        first.close()   # finishes the write-behind
    engine = make(tiny_llama, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=0.01)
    try:
        assert run_turns(engine, [A2]) == reference[2:]
        disk = engine.kv_tiers.store.stats().tier(Tier.DISK)
        assert disk.hits == 9 and engine.kv_tiers.store.stats().tier(Tier.HOST) is None
        assert served_from_tiers(engine) == 9
    finally:
        engine.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_killed_worker_restarts_warm_only_with_write_through(tiny_llama, reference, tmp_path, policy):
    """A's pages are never evicted from the first engine's pool, so only write-through put them on
    disk; the first engine is not closed before the second opens the directory (a kill -9: nothing
    flushed at exit, only what the write-behind thread had written)."""
    first = make(tiny_llama, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=0.01, kv_write_policy=policy)
    second = None
    try:
        assert run_turns(first, [A]) == reference[:1]
        assert first.kv_tiers.store.flush(timeout=10)
        second = make(tiny_llama, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=0.01, kv_write_policy=policy)
        assert run_turns(second, [A2]) == reference[2:]
        assert served_from_tiers(second) == (9 if policy == "write_through" else 0)
    finally:
        first.close()
        if second is not None:
            second.close()


def test_corrupt_l3_block_is_recomputed(tiny_llama, reference, tmp_path):
    first = make(tiny_llama, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=0.01)
    try:
        run_turns(first, [A, B])
        tiers = first.kv_tiers
    finally:
        first.close()
    # Flip a byte in the payload of A's fourth block: blocks 0-2 load, the rest is recomputed.
    from tandem.kvblocks.keys import block_hashes
    keys = block_hashes(tiers.namespace, PREFIX)
    path = tiers.store.disk.path(keys[3])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    engine = make(tiny_llama, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=0.01)
    try:
        assert run_turns(engine, [A2]) == reference[2:]
        stats = engine.kv_tiers.store.stats()
        assert stats.tier(Tier.DISK).hits == 3 and stats.misses == 1
        assert served_from_tiers(engine) == 3
        # The corrupt file was removed at the miss; under write-through (the default) the recomputed
        # page is written again, so once the writer is done the file is back with the right bytes.
        assert engine.kv_tiers.store.flush(timeout=10)
        assert path.read_bytes() != bytes(data)
        assert engine.kv_tiers.store.disk.contains(keys[3])
    finally:
        engine.close()


def test_tier_flags_are_validated(tiny_llama, tmp_path):
    with pytest.raises(InvalidRequest, match="--kv-host-cache-gb") as e:
        make(tiny_llama, kv_host_cache_gb=-1.0)
    assert e.value.param == "kv_host_cache_gb"
    with pytest.raises(InvalidRequest, match="--kv-disk-cache-gb"):
        make(tiny_llama, kv_disk_cache_dir=str(tmp_path), kv_disk_cache_gb=0)
    with pytest.raises(InvalidRequest, match="prefix cache"):
        LLMEngine(EngineConfig(model=str(tiny_llama), kv_host_cache_gb=1.0, enable_prefix_cache=False))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--kv-disk-cache-dir"):
        make(tiny_llama, kv_disk_cache_dir=str(blocker))


def test_a_request_waits_for_its_load_while_another_decodes(tiny_llama, reference):
    """A2's prefix loads from L2 through a gated page write; meanwhile C keeps decoding one token a
    step, A2 computes nothing; once the gate opens A2's tokens are the recomputed ones."""
    engine = make(tiny_llama, kv_host_cache_gb=0.01, max_total_tokens=96)
    try:
        run_turns(engine, [A])
        kv = engine.scheduler.kv
        kv.cache.evict(kv.num_pages)   # all of A to L2
        gate = threading.Event()
        real = engine.kv_tiers.write_page
        engine.kv_tiers.write_page = lambda page, payload: (gate.wait(10), real(page, payload))
        c = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
        tokens = {c: []}
        while not tokens[c]:
            for out in engine.step():
                tokens[out.rid].extend(out.token_ids)
        a2 = engine.add_request(A2, GREEDY)
        tokens[a2] = []
        for _ in range(5):
            before = len(tokens[c])
            for out in engine.step():
                tokens[out.rid].extend(out.token_ids)
            assert len(tokens[c]) == before + 1   # C's steps go on while A2 loads
        assert kv.is_loading(engine._tracked[a2].req) and tokens[a2] == []
        gate.set()
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.rid].extend(out.token_ids)
        assert tokens[a2] == reference[2] and len(tokens[c]) == 20
        assert served_from_tiers(engine) == 9
        engine.check_idle()
    finally:
        gate.set()
        engine.close()
