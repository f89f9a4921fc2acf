"""Router metrics, on a registry of their own so that several routers can live in one process (tests).

Besides its own counters the router exports what the SLO planner reads (services/planner/observe.py,
docs/planner.md): arrivals, prompt and output lengths, TTFT and inter-token latency as the client
sees them, and every registered worker's last announced load and fitted step costs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.services.common.registry import ROLE_NAMES
from tandem.v1 import worker_pb2

log = logging.getLogger(__name__)

# Fine enough between 0.1 and 5 s for the planner's percentiles (interpolated within a bucket).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.175, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.5, 5.0, 7.5, 10.0,
                30.0, 60.0)
ITL_BUCKETS = (0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.0, 5.0)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tandem_router_requests", "Generate requests by final gRPC status", ["status"], registry=self.registry
        )
        self.inflight = Gauge("tandem_router_inflight_requests", "Generate requests in flight", registry=self.registry)
        self.ttft = Histogram(
            "tandem_router_ttft_seconds", "Time from request arrival to the first token sent to the client",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.retries = Counter(
            "tandem_router_retries", "Requests retried on another pair after UNAVAILABLE", registry=self.registry
        )
        self.fallbacks = Counter(
            "tandem_router_fallbacks", "Disagg attempts prefilled on their decode worker because no prefill worker "
            "could take them (decode-only fallback), by reason: no_prefill_worker (none registered or every one "
            "failed), circuits_open (every prefill worker's circuit breaker is open)",
            ["reason"], registry=self.registry,
        )
        self.migrations = Counter(
            "tandem_router_migrations", "Streams that broke after tokens reached the client, by outcome: "
            "migrated (continued on another pair), exhausted (--max-migrations reached), no_worker (nothing "
            "left to continue on), unsupported (nothing left of max_tokens), deadline (the request's deadline passed)",
            ["outcome"], registry=self.registry,
        )
        self.open_circuits = Gauge(
            "tandem_router_open_circuits", "Workers skipped by their open circuit breaker", registry=self.registry
        )
        self.prefill_route = Counter(
            "tandem_router_prefill_route", "Disaggregated requests by where their prompt was prefilled: on a "
            "prefill worker (remote) or on the decode worker (local)", ["route"], registry=self.registry,
        )
        self.kv_reuse = Counter(
            "tandem_router_kv_reuse", "Disaggregated requests whose decode worker held more of the prompt than their "
            "prefill worker, by the cost model's decision: fetch that KV from it, or compute it (--kv-reuse-policy)",
            ["decision"], registry=self.registry,
        )
        self.workers = Gauge("tandem_router_workers", "Registered workers by role", ["role"], registry=self.registry)
        # The admission queue (admission.py): who waits for an in-flight slot, and who was shed.
        self.queued = Gauge("tandem_router_queued_requests", "Requests waiting in the router queue for an in-flight "
                            "slot (--max-queued-requests)", registry=self.registry)
        self.shed = Counter("tandem_router_shed_requests", "Queued requests shed with RESOURCE_EXHAUSTED because they "
                            "could no longer start in time (their deadline passed, or --queue-timeout-secs)",
                            registry=self.registry)
        # KV events from the workers (services/router/kv_feed.py; Redis registry only).
        self.kv_events_applied = Counter(
            "tandem_router_kv_events_applied", "KV block events applied to the router's exact per-worker views",
            registry=self.registry)
        self.kv_event_messages = Counter(
            "tandem_router_kv_event_messages", "KV event messages read, by kind (batch | snapshot | invalid) and "
            "result (applied | ignored: a duplicate, another boot, or a batch while waiting for a snapshot)",
            ["kind", "result"], registry=self.registry)
        self.kv_snapshot_requests = Counter(
            "tandem_router_kv_snapshot_requests", "Snapshots asked of workers (router start, new worker, sequence "
            "gap, new boot epoch)", registry=self.registry)
        self.kv_exact_workers = Gauge(
            "tandem_router_kv_exact_workers", "Workers whose KV events view is exact now (the others are routed "
            "by the approximate index)", registry=self.registry)
        # What the planner reads (docs/planner.md).
        self.arrivals = Counter(
            "tandem_router_arrivals", "Generate requests as they arrive, before validation and admission",
            registry=self.registry)
        self.prompt_tokens = Histogram(
            "tandem_router_prompt_tokens", "Prompt tokens of each request that finished", buckets=TOKEN_BUCKETS,
            registry=self.registry)
        self.output_tokens = Histogram(
            "tandem_router_output_tokens", "Output tokens sent to the client by each request that finished",
            buckets=TOKEN_BUCKETS, registry=self.registry)
        self.itl = Histogram(
            "tandem_router_itl_seconds", "Gaps between tokens sent to the client after the first (a chunk of n "
            "tokens after a gap g counts n gaps of g/n)", buckets=ITL_BUCKETS, registry=self.registry)
        self.worker_loads = WorkerLoadCollector()
        self.registry.register(self.worker_loads)
        self._httpd = None

    def watch_workers(self, source: Callable[[], Iterable[worker_pb2.WorkerInfo]]) -> None:
        """Export the load each worker of `source()` last announced, read at every scrape."""
        self.worker_loads.source = source

    def count_route(self, route: str) -> None:
        self.prefill_route.labels(route).inc()

    def count_reuse(self, decision: str) -> None:
        self.kv_reuse.labels(decision).inc()

    def observe_itl(self, gap_s: float, tokens: int) -> None:
        for _ in range(tokens):
            self.itl.observe(gap_s / tokens)

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint (in a thread); returns the bound port."""
        self._httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._httpd.server_port

    def close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()


_LOAD_GAUGES = (
    ("running", "Requests running on the worker (its last announced load)"),
    ("waiting", "Requests queued on the worker"),
    ("prefill_tokens", "Prompt tokens the worker has still to prefill: queued, and left of those in prefill"),
    ("kv_usage", "Fraction of the worker's KV pages in use"),
)
_STEP_GAUGES = (
    ("step_base_seconds", "base_s", "Fitted step time's constant term (seconds per step)"),
    ("step_decode_row_seconds", "per_decode_row_s", "Fitted step time per decode row"),
    ("step_prefill_token_seconds", "per_prefill_token_s", "Fitted step time per prefill token"),
)


class WorkerLoadCollector(Collector):
    """`tandem_router_worker_*{worker, role}` gauges from the registry's WorkerInfo at scrape time
    (the step-cost terms only for workers that reported a fit)."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[worker_pb2.WorkerInfo]] | None = None

    def collect(self):
        families = {name: GaugeMetricFamily(f"tandem_router_worker_{name}", doc, labels=["worker", "role"])
                    for name, doc in _LOAD_GAUGES}
        steps = {name: GaugeMetricFamily(f"tandem_router_worker_{name}", doc, labels=["worker", "role"])
                 for name, _, doc in _STEP_GAUGES}
        for w in self.source() if self.source is not None else ():
            labels = [w.worker_id, ROLE_NAMES.get(w.role, "unknown")]
            load = w.load
            usage = 1.0 - load.free_pages / load.total_pages if load.total_pages else 0.0
            for name, value in (("running", load.running), ("waiting", load.waiting),
                                ("prefill_tokens", load.prefill_tokens), ("kv_usage", usage)):
                families[name].add_metric(labels, float(value))
            if load.HasField("step_cost") and load.step_cost.steps:
                for name, field, _ in _STEP_GAUGES:
                    steps[name].add_metric(labels, getattr(load.step_cost, field))
        yield from families.values()
        yield from steps.values()
