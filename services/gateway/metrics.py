"""Gateway metrics, on a registry of their own (several gateways can live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class GatewayMetrics:
    def __init__(self, max_inflight: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_gateway_requests", "HTTP requests by endpoint and final status",
                                ["endpoint", "status"], registry=r)
        self.inflight = Gauge("tandem_gateway_inflight_requests", "Generation requests in flight", registry=r)
        Gauge("tandem_gateway_inflight_capacity", "Bound on requests in flight (beyond it: 429)",
              registry=r).set(max_inflight)
        self.ttft = Histogram("tandem_gateway_ttft_seconds", "Request arrival to the first token sent",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("tandem_gateway_request_seconds", "Request arrival to the last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tandem_gateway_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.completion_tokens = Counter("tandem_gateway_completion_tokens",
                                         "Generated tokens of finished requests", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
