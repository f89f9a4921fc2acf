"""What the planner sees: one `Observation` per interval, from two scrapes of the router's /metrics.

Counters and histograms are cumulative, so an interval's numbers are the difference between two
scrapes: arrivals per second, the mean prompt and output length of the requests that finished, TTFT
and ITL quantiles interpolated within the buckets of the difference (Prometheus' histogram_quantile).
Gauges (the workers' last announced load and fitted step costs, `tandem_router_worker_*`) are read as
they are. A counter that went down (the router restarted) counts from zero. Torch-free.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class StepCost:
    """A role's fitted step time, averaged over its workers: base + per_row·rows + per_token·tokens."""

    base_s: float
    per_row_s: float
    per_token_s: float


@dataclass(frozen=True)
class Observation:
    t: float                                   # wall clock at the second scrape
    interval_s: float
    arrival_rate: float                        # requests/s that arrived
    finished: int                              # requests that finished (their lengths are below)
    prompt_tokens: float | None                # means over the finished requests (None: none finished)
    output_tokens: float | None
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_samples: int = 0
    itl_p50: float | None = None
    itl_p90: float | None = None
    itl_mean: float | None = None
    itl_samples: int = 0
    queued_prefill_tokens: float = 0.0         # all workers: prompt tokens still to prefill
    kv_usage: float = 0.0                      # the fullest worker's fraction of KV pages in use
    workers: dict[str, int] = field(default_factory=dict)        # role -> registered workers
    running: dict[str, float] = field(default_factory=dict)      # role -> requests running
    step_costs: dict[str, StepCost] = field(default_factory=dict)  # role -> mean fit of its workers

    def quantile(self, kind: str, q: float) -> float | None:
        return getattr(self, f"{kind}_p{round(q * 100)}", None)

    def to_json(self) -> dict:
        return {"interval_s": round(self.interval_s, 3), "arrival_rate": round(self.arrival_rate, 4),
                "finished": self.finished, "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "ttft_p50": self.ttft_p50, "ttft_p90": self.ttft_p90, "itl_p50": self.itl_p50,
                "itl_p90": self.itl_p90, "itl_mean": self.itl_mean,
                "queued_prefill_tokens": self.queued_prefill_tokens, "kv_usage": round(self.kv_usage, 4),
                "workers": self.workers,
                "step_costs": {r: [c.base_s, c.per_row_s, c.per_token_s] for r, c in self.step_costs.items()}}


@dataclass
class Scrape:
    """One parse of the metrics text: samples by (name, sorted labels)."""

    t: float
    samples: dict[tuple[str, tuple], float]

    @classmethod
    def parse(cls, text: str, t: float) -> Scrape:
        return cls(t, {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for fam in text_string_to_metric_families(text) for s in fam.samples})

    def value(self, name: str) -> float:
        return self.samples.get((name, ()), 0.0)

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """(upper bound, cumulative count) of histogram `name`, by bound."""
        out = [(float(dict(labels)["le"]), v) for (n, labels), v in self.samples.items() if n == f"{name}_bucket"]
        return sorted(out)

    def by_worker(self, name: str) -> list[tuple[str, float]]:
        """(role, value) of every worker's gauge `name`."""
        return [(dict(labels).get("role", ""), v) for (n, labels), v in self.samples.items() if n == name]


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Quantile `q` of cumulative `buckets` [(le, count)] by linear interpolation within its bucket
    (in the +Inf bucket: the largest finite bound). None without samples."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def _delta(new: float, old: float) -> float:
    return new - old if new >= old else new   # a reset counts from zero


def observation(prev: Scrape, cur: Scrape) -> Observation:
    """The interval between two scrapes of the router."""
    dt = max(cur.t - prev.t, 1e-9)

    def d(name: str) -> float:
        return _delta(cur.value(name), prev.value(name))

    def dbuckets(name: str) -> list[tuple[float, float]]:
        old = dict(prev.buckets(name))
        fresh = cur.buckets(name)
        reset = any(v < old.get(le, 0.0) for le, v in fresh)
        return [(le, v if reset else v - old.get(le, 0.0)) for le, v in fresh]

    def mean(name: str) -> float | None:
        n = d(f"{name}_count")
        return d(f"{name}_sum") / n if n > 0 else None

    ttft, itl = dbuckets("tandem_router_ttft_seconds"), dbuckets("tandem_router_itl_seconds")
    workers: dict[str, int] = defaultdict(int)
    running: dict[str, float] = defaultdict(float)
    for role, v in cur.by_worker("tandem_router_worker_running"):
        workers[role] += 1
        running[role] += v
    fits: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for (n, labels), base in cur.samples.items():
        if n == "tandem_router_worker_step_base_seconds":
            per_row = cur.samples.get(("tandem_router_worker_step_decode_row_seconds", labels), 0.0)
            per_token = cur.samples.get(("tandem_router_worker_step_prefill_token_seconds", labels), 0.0)
            fits[dict(labels).get("role", "")].append((base, per_row, per_token))
    return Observation(
        t=cur.t, interval_s=dt, arrival_rate=d("tandem_router_arrivals_total") / dt,
        finished=int(d("tandem_router_prompt_tokens_count")),
        prompt_tokens=mean("tandem_router_prompt_tokens"), output_tokens=mean("tandem_router_output_tokens"),
        ttft_p50=histogram_quantile(0.5, ttft), ttft_p90=histogram_quantile(0.9, ttft),
        ttft_samples=int(ttft[-1][1]) if ttft else 0,
        itl_p50=histogram_quantile(0.5, itl), itl_p90=histogram_quantile(0.9, itl),
        itl_mean=mean("tandem_router_itl_seconds"), itl_samples=int(itl[-1][1]) if itl else 0,
        queued_prefill_tokens=sum(v for _, v in cur.by_worker("tandem_router_worker_prefill_tokens")),
        kv_usage=max((v for _, v in cur.by_worker("tandem_router_worker_kv_usage")), default=0.0),
        workers=dict(workers), running=dict(running),
        step_costs={role: StepCost(*(sum(f[i] for f in fs) / len(fs) for i in range(3)))
                    for role, fs in fits.items()},
    )


class RouterObserver:
    """Scrapes the router's /metrics; `observe()` gives the interval since the previous scrape (None
    the first time, or when the router cannot be reached: the next good scrape starts a new interval)."""

    def __init__(self, url: str, timeout_s: float = 5.0, fetch=None, clock=time.time):
        self.url = url
        self.timeout_s = timeout_s
        self._fetch = fetch or self._http
        self._clock = clock
        self._prev: Scrape | None = None
        self.error: str | None = None     # why the last scrape failed

    def _http(self) -> str:
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:
            return resp.read().decode()

    def observe(self) -> Observation | None:
        try:
            cur = Scrape.parse(self._fetch(), self._clock())
        except (OSError, ValueError) as e:
            self.error = f"{type(e).__name__}: {e}"
            self._prev = None
            return None
        self.error = None
        prev, self._prev = self._prev, cur
        return None if prev is None else observation(prev, cur)
