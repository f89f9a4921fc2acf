"""Capacity at SLO (`tandem bench sweep --find-capacity`): the highest Poisson request rate at which at
least `goal` (90%) of requests meet the SLO, found per deployment by raising the rate until the share
drops below the goal, then bisecting; repeated over seeds (a fresh prompt set and arrival sequence
each) to give a spread. Beside it, the compute limit: the rate at which the box's cores would be fully
busy on the model's FLOPs for this workload, at the dense matmul peak measured here in the served dtype.

The search is a pure state machine (`CapacitySearch`), the limit pure arithmetic (`request_flops`), so
both are tested without a deployment; `measure_peak_flops` is the one measurement.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CapacityConfig:
    goal: float = 0.9            # share of requests that must meet the SLO
    start_rate: float = 0.5      # req/s of the first run
    max_rate: float = 64.0       # the search stops raising here (capacity reported as ">= max_rate")
    min_rate: float = 0.05       # ... and lowering here (capacity 0)
    bisect_steps: int = 3        # runs between the last pass and the first failure
    seeds: int = 2
    # Seconds of arrivals per run: a run sends max(--num-prompts, rate x duration) requests, so a queue
    # that grows at a rate above capacity has time to show (0: always --num-prompts, which at high
    # rates is a burst of a few seconds that a backlog can absorb, and flatters).
    duration_s: float = 60.0

    def validate(self) -> None:
        if not 0 < self.goal <= 1:
            raise ValueError(f"--capacity-goal must be in (0, 1], got {self.goal}")
        if not 0 < self.min_rate <= self.start_rate <= self.max_rate:
            raise ValueError("capacity rates must satisfy 0 < min <= start <= max")
        if self.bisect_steps < 0 or self.seeds < 1:
            raise ValueError("--capacity-steps must be >= 0 and --capacity-seeds >= 1")
        if self.duration_s < 0:
            raise ValueError(f"--capacity-duration must be >= 0, got {self.duration_s}")

    def num_prompts(self, rate: float, floor: int) -> int:
        """Requests of a run at `rate`: `duration_s` of arrivals, at least `floor` (--num-prompts)."""
        return max(floor, math.ceil(rate * self.duration_s))


def attainment(metrics: dict) -> float:
    """The share of a run's requests (failed ones included) that met the SLO."""
    total = metrics["completed"] + metrics["failed"]
    return metrics["good_requests"] / total if total else 0.0


@dataclass
class CapacitySearch:
    """Which rate to run next (`next_rate`) given what the runs so far attained (`record`): doubling from
    `start_rate` until a run misses the goal (halving if the first does), then bisecting between the
    highest rate that met it and the lowest that did not. A noisy pass above a failure does not move
    the bracket past the failure."""

    cfg: CapacityConfig
    passed: float | None = None       # the highest rate that met the goal, below `failed`
    failed: float | None = None       # the lowest rate that missed it
    tried: list[tuple[float, float]] = field(default_factory=list)   # (rate, attainment), in run order
    _bisected: int = 0

    def next_rate(self) -> float | None:
        c = self.cfg
        if not self.tried:
            return c.start_rate
        if self.failed is None:                      # every run met the goal so far: double
            rate = 2 * self.passed
            return rate if rate <= c.max_rate else None
        if self.passed is None:                      # every run missed it: halve
            rate = self.failed / 2
            return rate if rate >= c.min_rate else None
        if self._bisected >= c.bisect_steps:
            return None
        self._bisected += 1
        return round((self.passed + self.failed) / 2, 4)

    def record(self, rate: float, attained: float) -> None:
        self.tried.append((rate, attained))
        if attained >= self.cfg.goal:
            if self.failed is None or rate < self.failed:
                self.passed = max(self.passed or 0.0, rate)
        else:
            self.failed = rate if self.failed is None else min(self.failed, rate)
            if self.passed is not None and self.passed >= self.failed:
                self.passed = max((r for r, a in self.tried if a >= self.cfg.goal and r < self.failed), default=None)

    @property
    def capacity(self) -> float:
        """The highest rate that met the goal (0 if none did)."""
        return self.passed or 0.0

    @property
    def capped(self) -> bool:
        """Every rate up to max_rate met the goal: the capacity is at least that."""
        return self.failed is None and bool(self.tried)


def summarize(searches: list[CapacitySearch]) -> dict:
    """Capacity over seeds: each seed's, their mean, min and max."""
    caps = [s.capacity for s in searches]
    return {"per_seed": caps, "mean": statistics.fmean(caps), "min": min(caps), "max": max(caps),
            "capped": any(s.capped for s in searches),
            "tried": [[list(t) for t in s.tried] for s in searches]}


# ---- the compute limit --------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a decoder-only transformer."""

    layers: int
    hidden: int
    intermediate: int
    q_size: int            # heads x head_dim
    kv_size: int           # kv heads x head_dim
    vocab: int

    @classmethod
    def of(cls, cfg) -> ModelShape:
        """From an engine ModelConfig."""
        return cls(cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.vocab_size)

    @property
    def body_params(self) -> int:
        """Weights every token multiplies by (projections and MLP of every layer; no embedding, no head)."""
        attn = self.hidden * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp)


def request_flops(shape: ModelShape, input_len: int, output_len: int) -> float:
    """FLOPs of one request: the prompt's prefill (logits of its last token only) and `output_len - 1`
    decode steps, matmuls only (2 per multiply-add): weights, attention scores and values (causal)."""
    head = 2 * shape.hidden * shape.vocab
    prefill = 2 * shape.body_params * input_len + head + 2 * shape.layers * shape.q_size * input_len * input_len
    decode = 0.0
    for t in range(input_len + 1, input_len + output_len):
        decode += 2 * shape.body_params + head + 4 * shape.layers * shape.q_size * t
    return prefill + decode


def measure_peak_flops(dtype: str, seconds: float = 2.0, n: int = 1024) -> float:
    """Dense matmul FLOP/s of this process's torch threads in `dtype` (the best of a few timed batches)."""
    import torch

    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    torch.matmul(a, b)                     # warm-up (oneDNN picks its kernel)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.matmul(a, b)
        best = max(best, 4 * 2 * n ** 3 / (time.perf_counter() - t0))
    return best


def compute_limit(shape: ModelShape, input_len: int, output_len: int, peak_flops: float) -> dict:
    """The request rate at which `peak_flops` would be spent on this workload's FLOPs alone."""
    flops = request_flops(shape, input_len, output_len)
    return {"request_gflop": flops / 1e9, "peak_gflop_s": peak_flops / 1e9, "rate": peak_flops / flops}


def find_capacity(run_one, cfg: CapacityConfig, echo=print, label: str = "") -> tuple[dict, list[dict]]:
    """Search each seed's capacity with `run_one(rate, seed) -> run dict` (a RateRun.to_dict with its
    "metrics"); returns the summary over seeds and every run, each tagged with its seed."""
    searches, runs = [], []
    for seed in range(cfg.seeds):
        search = CapacitySearch(cfg)
        while (rate := search.next_rate()) is not None:
            run = run_one(rate, seed)
            share = attainment(run["metrics"])
            search.record(rate, share)
            runs.append({**run, "seed": seed, "slo_attainment": share})
            echo(f"--- {label} capacity seed {seed}: {rate:g} req/s -> {share:.0%} within the SLO")
        searches.append(search)
        echo(f"--- {label} capacity seed {seed}: {search.capacity:g} req/s"
             f"{' (or more: every rate tried met the goal)' if search.capped else ''}")
    return summarize(searches), runs


def report(model: str, dtype: str, dataset, deployments: dict, echo=print) -> dict:
    """Each deployment's capacity (`deployments[name]["capacity"]`), its share of the compute limit of
    `dataset`'s lengths in `dtype` here, and its ratio to vLLM's where vLLM ran."""
    from tandem.engine.models.config import ModelConfig
    from tandem.engine.models.source import resolve_model

    folder = model if Path(model, "config.json").is_file() else resolve_model(model)   # only its config is read
    shape = ModelShape.of(ModelConfig.from_pretrained(folder))
    limit = compute_limit(shape, dataset.input_len, dataset.output_len, measure_peak_flops(dtype))
    caps = {name: d["capacity"] for name, d in deployments.items() if "capacity" in d}
    vllm = caps.get("vllm", {}).get("mean")
    out = {"limit": limit, "deployments": {}}
    echo(f"compute limit: {limit['rate']:.2f} req/s ({limit['request_gflop']:.1f} GFLOP per request at "
         f"{limit['peak_gflop_s']:.0f} GFLOP/s, the {dtype} matmul peak here)")
    for name, c in caps.items():
        row = {**c, "share_of_limit": c["mean"] / limit["rate"]}
        if vllm:
            row["vs_vllm"] = c["mean"] / vllm
        out["deployments"][name] = row
        echo(f"capacity {name}: {c['mean']:.2f} req/s (seeds {', '.join(f'{x:g}' for x in c['per_seed'])}), "
             f"{row['share_of_limit']:.0%} of the limit" + (f", {row['vs_vllm']:.2f}x vLLM" if "vs_vllm" in row else ""))
    return out
