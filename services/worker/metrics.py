"""Prometheus metrics every worker exports on its /metrics endpoint."""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

QUEUE_LEN = Gauge("tandem_queue_length", "Requests in each scheduler queue", ["queue"])
QUEUE_CAP = Gauge("tandem_queue_capacity", "Bound of each scheduler queue", ["queue"])
KV_PAGES = Gauge("tandem_kv_pages", "KV pages by state (free includes evictable prefix-cache pages)", ["state"])
SLOTS_FREE = Gauge("tandem_request_slots_free", "Free request slots")
REQUESTS = Counter("tandem_worker_requests_total", "Requests finished, by outcome", ["outcome"])
TRANSFER_SPEED = Gauge("kv_transfer_speed_gb_s", "Speed of the last completed KV transfer (GB/s)")
TRANSFER_LATENCY = Histogram(
    "kv_transfer_latency_ms", "KV transfer time per room, first write to completion (ms)",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000),
)
IDLE_CHECK_FAILURES = Counter("tandem_idle_check_failures_total", "Idle self-checks that found leaked pages/slots")
STEPS = Counter("tandem_engine_steps_total", "Forward passes run", ["kind"])
# Per step, measured on the engine thread (services/worker/step_stats.py); kind: prefill, decode, or
# mixed (prefill chunks and decode rows in one step).
STEP_TIME = Histogram(
    "tandem_step_duration_seconds", "Wall time of one engine step (forward pass, sampling, hand-off)", ["kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
             2.5, 5.0, 10.0))
STEP_BATCH_SIZE = Histogram("tandem_step_batch_size", "Sequences in one engine step", ["kind"],
                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
STEP_TOKENS = Histogram("tandem_step_tokens", "Tokens run in one engine step (prefill tokens + decode rows)",
                        ["kind"], buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
GRAPH_STEPS = Counter("tandem_graph_steps_total",
                      "Decode steps run from a captured graph (engine/runner/graph_runner.py); the others run eagerly")
STEP_TOKENS_TOTAL = Counter("tandem_engine_tokens_total",
                            "Tokens run by engine steps: phase=prefill (prompt chunks), decode (new tokens)",
                            ["phase"])
REQUESTS_RUNNING = Gauge("tandem_requests_running", "Requests running on this worker (as in WorkerLoad)")
REQUESTS_WAITING = Gauge("tandem_requests_waiting", "Requests queued on this worker, not yet running")
KV_TRANSFERS_OUTSTANDING = Gauge(
    "tandem_kv_transfers_outstanding",
    "Prefill: rooms whose decode worker reserved pages and still waits for their KV (a drain waits for 0)")
KV_INTEGRITY_FAILURES = Counter(
    "tandem_kv_integrity_failures_total",
    "KV that did not match its checksum and was never used (fetched again or recomputed instead), by backend: "
    "the data path a transfer came over (shm, tcp, nixl, ucx; decode workers) or the tier a block was loaded "
    "from (tier_host, tier_disk)", ["backend"])
TRANSFER_OUTLIVED_TIMEOUT = Counter(
    "tandem_kv_transfer_outlived_timeout_total",
    "Decode: rooms still waiting for their KV --transfer-timeout after the bootstrap, kept because the "
    "prefill worker reports progress (a slow prefill, not a failure)")
DRAINING = Gauge("tandem_worker_draining", "1 once SIGTERM started the drain")
UCX_TRANSPORT = Gauge(
    "tandem_kv_ucx_transport_info", "1 per peer: the UCX transport the nixl/ucx backend negotiated with it",
    ["peer", "transport", "rdma"])

# The names the Gateway API Inference Extension's endpoint picker (and llm-d) scrape from vLLM pods,
# so such a gateway can pick Tandem pods. Same meaning as vLLM's: waiting = queued, not yet running.
KV_USAGE = Gauge("tandem_kv_cache_usage", "KV pages in use / total, 0..1 (what the decode autoscaler targets)")
VLLM_WAITING = Gauge("vllm:num_requests_waiting", "Requests queued (vLLM-compatible name)", ["model_name"])
VLLM_RUNNING = Gauge("vllm:num_requests_running", "Requests running (vLLM-compatible name)", ["model_name"])
VLLM_KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1 (vLLM-compatible name)", ["model_name"])


# The KV tiers below the pool (engine/kvcache/tiers/; co-located workers with --kv-host-cache-gb or
# --kv-disk-cache-dir). tier: host | disk; direction: read (loaded back) | write (stored into it).
KV_TIER_HITS = Counter("tandem_kv_tier_hits_total", "KV blocks loaded from a tier below the pool instead of recomputed",
                       ["tier"])
KV_TIER_BYTES = Counter("tandem_kv_tier_bytes_total", "Bytes of KV blocks moved into or out of a tier below the pool",
                        ["tier", "direction"])
_TIER_BLOCK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
KV_TIER_LOAD_TIME = Histogram(
    "tandem_kv_tier_load_seconds", "Loading one KV block from a tier into a pool page (read, checksum, copy)",
    ["tier"], buckets=_TIER_BLOCK_BUCKETS)
KV_TIER_STORE_TIME = Histogram(
    "tandem_kv_tier_store_seconds",
    "Storing one KV block into a tier (host: the demotion copy on the engine thread; disk: the write-behind file)",
    ["tier"], buckets=_TIER_BLOCK_BUCKETS)
KV_TIER_LOAD_WAIT = Histogram(
    "tandem_kv_tier_load_wait_seconds", "What a request waited for its prefix to load from the tiers (all its blocks)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
# KV events to the router (services/worker/kv_events.py; --kv-events, with a Redis registry).
KV_FETCHES = Counter("tandem_kv_fetches_total",
                     "Prefill worker: fetches of a prompt prefix from its decode peer (KV both ways), by outcome",
                     ["outcome"])
KV_FETCHED_TOKENS = Counter("tandem_kv_fetched_tokens_total",
                            "Prefill worker: prompt tokens fetched from decode workers instead of computed")
KV_PREFIX_SENDS = Counter("tandem_kv_prefix_sends_total",
                          "Decode worker: SendPrefix calls from prefill workers, by outcome", ["outcome"])
KV_EVENTS_PUBLISHED = Counter("tandem_kv_events_published_total",
                              "KV block events (stored / removed, any tier) written to this worker's event stream")
KV_EVENT_MESSAGES = Counter("tandem_kv_event_messages_total",
                            "KV event messages written to this worker's event stream, by kind (batch | snapshot)",
                            ["kind"])
KV_EVENT_MESSAGES_LOST = Counter("tandem_kv_event_messages_lost_total",
                                 "KV event messages lost to Redis errors (the next message is a snapshot)")


class KVTierExport:
    """Exports what a TieredStore's counters (`StoreStats`) gained since the previous call."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], int] = {}

    def __call__(self, stats, timings=None) -> None:
        """`timings`: the store's `TierTimings`, drained into the latency histograms."""
        if timings is not None:
            blocks, loads = timings.drain()
            for op, tier, seconds in blocks:
                hist = KV_TIER_LOAD_TIME if op.value == "load" else KV_TIER_STORE_TIME
                hist.labels(tier.label).observe(seconds)
            for seconds in loads:
                KV_TIER_LOAD_WAIT.observe(seconds)
        for t in stats.tiers:
            label = t.tier.label
            for name, value, counter in (("hits", t.hits, KV_TIER_HITS.labels(label)),
                                         ("read", t.bytes_read, KV_TIER_BYTES.labels(label, "read")),
                                         ("write", t.bytes_written, KV_TIER_BYTES.labels(label, "write"))):
                gained = value - self._last.get((label, name), 0)
                if gained > 0:
                    counter.inc(gained)
                self._last[(label, name)] = value
            gained = t.corrupt - self._last.get((label, "corrupt"), 0)
            if gained > 0:
                KV_INTEGRITY_FAILURES.labels(f"tier_{label}").inc(gained)
            self._last[(label, "corrupt")] = t.corrupt



def kv_tier_exporter(engine) -> Callable[[], None]:
    """What each role's metrics export calls for the engine's KV tiers (a no-op with tiers off)."""
    if engine.kv_tiers is None:
        return lambda: None
    export = KVTierExport()
    store = engine.kv_tiers.store
    return lambda: export(store.stats(), store.timings)

def export_kv(stats) -> None:
    """KV pages and request slots from the scheduler's `SchedulerStats` (each role's metrics export calls it)."""
    KV_PAGES.labels("free").set(stats.free_pages)
    KV_PAGES.labels("total").set(stats.total_pages)
    SLOTS_FREE.set(stats.free_slots)


def export_vllm_compatible(model: str, load) -> None:
    """Mirror a worker's `WorkerLoad` under vLLM's metric names (each role's metrics export calls it)."""
    VLLM_WAITING.labels(model).set(load.waiting)
    VLLM_RUNNING.labels(model).set(load.running)
    REQUESTS_WAITING.set(load.waiting)
    REQUESTS_RUNNING.set(load.running)
    usage = 1.0 - load.free_pages / load.total_pages if load.total_pages else 0.0
    KV_USAGE.set(usage)
    VLLM_KV_USAGE.labels(model).set(usage)


def idle_check(engine) -> None:
    """The idle self-check (every page free or evictable, every slot free); a failure is logged and
    counted rather than raised, so one leak does not take the worker down with it."""
    try:
        engine.check_idle()
    except AssertionError as e:
        IDLE_CHECK_FAILURES.inc()
        log.error("idle self-check failed: %s", e)

# Speculative decoding (engine/spec/; exported by services/worker/spec_metrics.py). Names follow
# vLLM's spec_decode counters; the acceptance length is accepted drafts per verified row.
SPEC_DRAFT_TOKENS = Counter("tandem_spec_draft_tokens_total", "Draft tokens verified by the target model")
SPEC_ACCEPTED_TOKENS = Counter("tandem_spec_accepted_tokens_total", "Draft tokens accepted")
SPEC_VERIFIED_ROWS = Counter("tandem_spec_verified_rows_total", "Request rows that verified drafts (one per step)")
SPEC_ACCEPT_LENGTH = Histogram(
    "tandem_spec_accept_length", "Drafts accepted per verified row per step (0..k)",
    buckets=(0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32))
SPEC_ENABLED = Gauge("tandem_spec_enabled", "1 while the adaptive gate lets the decode batch speculate")
