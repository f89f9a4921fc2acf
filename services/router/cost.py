"""What a routing decision weighs, per candidate worker: one cost model for every choice the router
makes (which prefill worker, which decode worker, prefill remotely or on the decode worker).

The unit is prompt tokens to compute before this request's first token: the prefill work already
queued on the worker plus the part of this prompt its prefix cache does not hold. A prefill worker
with a cached prefix is cheaper by exactly the tokens it need not compute; a decode worker with one
receives that many fewer tokens' pages. Load in requests (running + queued + this router's in-flight)
is the second measure, used to keep workers balanced (`cache_aware`'s thresholds) and to break ties.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.v1 import worker_pb2

# What a fetch costs besides moving its bytes: P's SendPrefix call to D and the transfer room's
# set-up and completion (a few round trips; ~2 ms measured on one host, more across hosts).
FETCH_OVERHEAD_S = 0.005


@dataclass(frozen=True)
class Candidate:
    """A worker as a routing choice for one request."""

    info: worker_pb2.WorkerInfo
    inflight: int = 0            # requests this router has in flight on it
    inflight_tokens: int = 0     # prompt tokens this router sent it to prefill whose first token is not back
    cached_tokens: int = 0       # of this prompt, what the router believes its prefix cache holds
    prompt_tokens: int = 0

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def queued_tokens(self) -> int:
        """Prefill work ahead of this request: the worker's last report, or what this router alone
        sent it since, whichever is larger (the report is up to a heartbeat old; other routers' work
        shows only in the report)."""
        return max(self.info.load.prefill_tokens, self.inflight_tokens)

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def prefill_cost(self) -> int:
        """Tokens this worker computes before this request's first token if it prefills it."""
        return self.queued_tokens + self.uncached_tokens

    @property
    def requests(self) -> int:
        load = self.info.load
        return load.running + load.waiting + self.inflight

    def decode_step_s(self) -> float | None:
        """What a decode step with every running request and one more takes on this worker, by its
        reported step-cost fit (None before the worker has fitted one)."""
        cost = self.info.load.step_cost
        if not cost.steps:
            return None
        return cost.base_s + cost.per_decode_row_s * (self.info.load.running + 1)

    def itl_with_prefill_s(self, tokens: int, itl_factor: float) -> float | None:
        """The inter-token latency its running requests see while it prefills `tokens` prompt tokens in
        mixed chunks: one decode step plus the prefill's compute, but at most `itl_factor` decode steps
        (the worker bounds each mixed step so: --mixed-chunk-itl-factor). None without a fit."""
        step = self.decode_step_s()
        if step is None:
            return None
        added = tokens * self.info.load.step_cost.per_prefill_token_s
        return step + min(added, (itl_factor - 1.0) * step)

    @property
    def free_ratio(self) -> float:
        load = self.info.load
        return load.free_pages / load.total_pages if load.total_pages else 0.0


def reuse_tokens(p: Candidate, d: Candidate, link_gbps: float) -> int:
    """KV both ways: the prompt tokens prefill worker `p` should fetch from decode worker `d` rather
    than compute (0: compute them). They are what D holds beyond P's own cache (a multi-turn prompt's
    earlier answers live only on D), and fetching pays when moving their KV — at P's measured fetch
    rate, else `link_gbps` — plus the fixed part of a fetch (P's measured, else FETCH_OVERHEAD_S) takes
    less than P computing them by its step-cost
    fit. With no fit yet the fetch is taken: on every CPU measured a link of 1 Gbit/s moves a token's
    KV several times faster than a prefill computes it (docs/benchmarks.md, "KV both ways")."""
    tokens = d.cached_tokens - p.cached_tokens
    per_token_bytes = d.info.kv_bytes_per_token or p.info.kv_bytes_per_token
    if tokens <= 0 or not per_token_bytes:
        return 0
    load = p.info.load
    gbps = load.kv_fetch_gbps or link_gbps
    overhead_s = load.kv_fetch_overhead_ms / 1e3 if load.kv_fetch_gbps else FETCH_OVERHEAD_S
    fetch_s = overhead_s + tokens * per_token_bytes * 8 / (gbps * 1e9)
    cost = p.info.load.step_cost
    if cost.steps and fetch_s >= tokens * cost.per_prefill_token_s:
        return 0
    return tokens
