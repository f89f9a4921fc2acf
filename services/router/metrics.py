"""Router metrics, on a registry of their own so that several routers can live in one process (tests)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


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
        self.workers = Gauge("tandem_router_workers", "Registered workers by role", ["role"], registry=self.registry)
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
        self._httpd = None

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint (in a thread); returns the bound port."""
        self._httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._httpd.server_port

    def close(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
