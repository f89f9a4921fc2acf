"""The worker's KV tier counters export what a TieredStore's stats gained, once."""

from __future__ import annotations

from prometheus_client import REGISTRY

from tandem.engine.kvcache.tiers.store import StoreStats, TierStats
from tandem.kvblocks.blocks import Tier
from tandem.services.worker import metrics


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def stats(hits: int, read: int, written: int) -> StoreStats:
    return StoreStats((TierStats(Tier.DISK, True, 1, written, 1 << 20, hits, read, written),), 0, 0, 0)


def test_kv_tier_counters_advance_by_what_the_store_gained():
    before = (sample("tandem_kv_tier_hits_total", tier="disk"),
              sample("tandem_kv_tier_bytes_total", tier="disk", direction="read"),
              sample("tandem_kv_tier_bytes_total", tier="disk", direction="write"))
    export = metrics.KVTierExport()
    export(stats(2, 200, 500))
    export(stats(2, 200, 500))   # nothing new: nothing counted twice
    export(stats(3, 300, 900))
    after = (sample("tandem_kv_tier_hits_total", tier="disk"),
             sample("tandem_kv_tier_bytes_total", tier="disk", direction="read"),
             sample("tandem_kv_tier_bytes_total", tier="disk", direction="write"))
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 300, 900]


def test_kv_tier_latencies_are_observed_once():
    from tandem.engine.kvcache.tiers.timings import TierOp, TierTimings

    before = (sample("tandem_kv_tier_load_seconds_count", tier="disk"),
              sample("tandem_kv_tier_store_seconds_count", tier="host"),
              sample("tandem_kv_tier_load_wait_seconds_count"))
    timings = TierTimings()
    timings.block(TierOp.LOAD, Tier.DISK, 0.002)
    timings.block(TierOp.LOAD, Tier.DISK, 0.003)
    timings.block(TierOp.STORE, Tier.HOST, 0.0001)
    timings.load(0.005)
    export = metrics.KVTierExport()
    export(stats(0, 0, 0), timings)
    export(stats(0, 0, 0), timings)   # drained: nothing observed twice
    after = (sample("tandem_kv_tier_load_seconds_count", tier="disk"),
             sample("tandem_kv_tier_store_seconds_count", tier="host"),
             sample("tandem_kv_tier_load_wait_seconds_count"))
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 1, 1]


def test_damaged_tier_blocks_count_as_integrity_failures_once():
    before = sample("tandem_kv_integrity_failures_total", backend="tier_host")
    export = metrics.KVTierExport()
    for corrupt in (1, 1, 3):
        export(StoreStats((TierStats(Tier.HOST, True, 1, 0, 1 << 20, 0, 0, 0, corrupt),), 0, 0, 0))
    assert sample("tandem_kv_integrity_failures_total", backend="tier_host") - before == 3
