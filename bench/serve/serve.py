"""One benchmark: a workload against one endpoint at one or more request rates -> JSON (+ PNG).

Rate i draws its prompts with seed + i, so a server's prefix cache never serves a prompt of an
earlier rate; warm-ups (their own seed) run once, before the first rate. With a load profile
(load_profile.py) there is one run instead, made of its phases, reported per phase and over time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.results import write_result
from tandem.bench.serve import load_profile as lp
from tandem.bench.serve import multiturn, plots
from tandem.bench.serve.backends import BackendConfig, make_backend
from tandem.bench.serve.datasets import DatasetConfig, build_dataset, describe, load_tokenizer
from tandem.bench.serve.metrics import (
    DEFAULT_PERCENTILES,
    SLO,
    BenchMetrics,
    MultiTurnMetrics,
    compute_metrics,
    format_multi_turn_summary,
    format_priority_summary,
    format_summary,
    metrics_by_priority,
    multi_turn_metrics,
)
from tandem.bench.serve.runner import LoadConfig, run_load

log = logging.getLogger(__name__)

WARMUP_SEED_OFFSET = 10_000


@dataclass(frozen=True)
class ServeConfig:
    backend: str = "openai-http"
    backend_cfg: BackendConfig = field(default_factory=lambda: BackendConfig(base_url="http://127.0.0.1:8000"))
    tokenizer: str = "smollm2-135m"
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    request_rates: tuple[float, ...] = (math.inf,)
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    slo: SLO = field(default_factory=SLO)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    progress: bool = True
    label: str = ""
    out: str | None = None               # results JSON; plots go beside it
    plot: bool = True
    save_requests: bool = True           # per-request records in the JSON
    trace_file: str | None = None        # the stack's spans file (file:// exporter): TTFT broken into phases
    load_profile: lp.LoadProfile | None = None   # phases of rate and lengths, instead of request_rates
    window_s: float = 5.0                # the load profile's time-series window


@dataclass
class RateRun:
    request_rate: float
    metrics: BenchMetrics
    records: list[dict]                  # RequestRecord.to_dict()
    by_priority: dict[int, BenchMetrics] = field(default_factory=dict)  # per class (--priority-mix)
    multi_turn: MultiTurnMetrics | None = None                          # the multi-turn dataset's view

    def to_dict(self, save_requests: bool) -> dict:
        d = {"request_rate": plots.rate_label(self.request_rate), "metrics": self.metrics.to_dict()}
        if self.by_priority:
            d["by_priority"] = {str(p): m.to_dict() for p, m in self.by_priority.items()}
        if self.multi_turn is not None:
            d["multi_turn"] = self.multi_turn.to_dict()
        if save_requests:
            d["requests"] = self.records
        return d


@dataclass
class ProfileRun:
    """One run of a load profile: the whole run (the profile's length as the window), each phase, the
    time series; `t0` is its start (time.perf_counter())."""

    profile: lp.LoadProfile
    metrics: BenchMetrics
    phases: list[lp.PhaseResult]
    series: list[dict]
    records: list[dict]
    t0: float

    def to_dict(self, save_requests: bool) -> dict:
        d = {"request_rate": "profile", "load_profile": str(self.profile), "metrics": self.metrics.to_dict(),
             "phases": [p.to_dict() for p in self.phases], "time_series": self.series}
        if save_requests:
            d["requests"] = self.records
        return d


async def run_profile(cfg: ServeConfig, tokenizer, echo=print) -> ProfileRun:
    """`cfg.load_profile` against one already-running endpoint (warm-ups first, with the first phase's lengths)."""
    profile = cfg.load_profile
    assert profile is not None
    if cfg.dataset.name == multiturn.NAME:
        raise ValueError("--load-profile sends prompts on a schedule; the multi-turn dataset is closed-loop")
    schedule = lp.arrival_schedule(profile, cfg.burstiness, cfg.dataset.seed)
    reqs = lp.build_requests(profile, schedule, cfg.dataset, tokenizer, build_dataset)
    first = profile.phases[0]
    warmups = []
    if cfg.num_warmups > 0:
        warmups = build_dataset(dataclasses.replace(cfg.dataset, num_prompts=cfg.num_warmups, input_len=first.input_len,
                                                    output_len=first.output_len,
                                                    seed=cfg.dataset.seed + WARMUP_SEED_OFFSET), tokenizer)
    echo(f"load profile: {profile} ({profile.duration_s:g} s, {len(reqs)} requests)")
    backend = make_backend(cfg.backend, cfg.backend_cfg)
    await backend.start()
    try:
        load = LoadConfig(burstiness=cfg.burstiness, max_concurrency=cfg.max_concurrency, seed=cfg.dataset.seed)
        result = await run_load(backend, reqs, load, warmups=warmups, progress=cfg.progress,
                                desc=f"{cfg.label + ' ' if cfg.label else ''}load profile",
                                offsets=[t for t, _ in schedule])
    finally:
        await backend.close()
    metrics = compute_metrics(result.records, profile.duration_s, cfg.slo, cfg.percentiles)
    phases = lp.phase_metrics(profile, result.records, cfg.slo, cfg.percentiles)
    series = lp.time_series(profile, result.records, result.t0, cfg.slo, cfg.window_s)
    echo(format_summary(metrics, f"{cfg.label + ': ' if cfg.label else ''}load profile {profile}", cfg.slo))
    echo(lp.format_phase_table(phases))
    return ProfileRun(profile, metrics, phases, series, [r.to_dict(result.t0) for r in result.records], result.t0)


async def run_rates(cfg: ServeConfig, tokenizer, echo=print) -> list[RateRun]:
    """Run `cfg`'s workload at each of its request rates against one already-running endpoint."""
    multi = cfg.dataset.name == multiturn.NAME
    if multi:
        multiturn.validate(cfg.dataset)     # before the warm-ups: a bad flag is a usage error, not a run
    backend = make_backend(cfg.backend, cfg.backend_cfg)
    await backend.start()
    try:
        warmups = []
        warm_seed = cfg.dataset.seed + WARMUP_SEED_OFFSET
        if multi:
            warmups = multiturn.warmup_requests(cfg.dataset, cfg.num_warmups, warm_seed, tokenizer)
        elif cfg.num_warmups > 0:
            warm_cfg = dataclasses.replace(cfg.dataset, num_prompts=cfg.num_warmups, seed=warm_seed)
            warmups = build_dataset(warm_cfg, tokenizer)
        runs = []
        for i, rate in enumerate(cfg.request_rates):
            dataset = dataclasses.replace(cfg.dataset, seed=cfg.dataset.seed + i)
            load = LoadConfig(request_rate=rate, burstiness=cfg.burstiness, max_concurrency=cfg.max_concurrency,
                              seed=cfg.dataset.seed + i)
            desc = f"{cfg.label + ' ' if cfg.label else ''}rate {plots.rate_label(rate)}"
            if multi:
                convs = multiturn.build_conversations(dataset, tokenizer)
                if i == 0:
                    echo(f"workload: {cfg.dataset.name}, {multiturn.describe(convs)}")
                result = await multiturn.run_conversations(backend, convs, load, tokenizer,
                                                           warmups=warmups if i == 0 else (),
                                                           progress=cfg.progress, desc=desc)
            else:
                reqs = build_dataset(dataset, tokenizer)
                if i == 0:
                    echo(f"workload: {cfg.dataset.name}, {describe(reqs)}")
                result = await run_load(backend, reqs, load, warmups=warmups if i == 0 else (),
                                        progress=cfg.progress, desc=desc)
            metrics = compute_metrics(result.records, result.duration_s, cfg.slo, cfg.percentiles)
            conc = f", max concurrency {cfg.max_concurrency}" if cfg.max_concurrency else ""
            what = "conversation start rate" if multi else "request rate"
            unit = "conversations/s" if multi else "req/s"
            echo(format_summary(metrics, f"{cfg.label + ': ' if cfg.label else ''}{what} "
                                          f"{plots.rate_label(rate)} {unit}, burstiness {cfg.burstiness:g}{conc}",
                                cfg.slo))
            by_priority = metrics_by_priority(result.records, result.duration_s, cfg.slo, cfg.percentiles)
            if by_priority:
                echo(format_priority_summary(by_priority))
            turns = None
            if multi:
                turns = multi_turn_metrics(result.records, dataset.multi_turn_conversations,
                                           dataset.multi_turn_turns, cfg.percentiles)
                echo(format_multi_turn_summary(turns))
            runs.append(RateRun(rate, metrics, [r.to_dict(result.t0) for r in result.records], by_priority, turns))
        return runs
    finally:
        await backend.close()


def run_serve(cfg: ServeConfig, echo=print) -> dict:
    """The `tandem bench serve` command: run, print summaries, write JSON and plots; return the JSON."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    began_ns = time.time_ns()
    if cfg.load_profile:
        runs: list[RateRun] | list[ProfileRun] = [asyncio.run(run_profile(cfg, tokenizer, echo))]
    else:
        runs = asyncio.run(run_rates(cfg, tokenizer, echo))
    result = {
        "tool": "tandem bench serve",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "config": config_dict(cfg),
        "runs": [r.to_dict(cfg.save_requests) for r in runs],
    }
    if cfg.trace_file:
        from tandem.bench.trace_breakdown import breakdown, format_table
        from tandem.cli.trace_cmd import load

        time.sleep(1.5)   # the processes export in batches every 0.5 s: let the last requests' spans land
        result["ttft_breakdown"] = breakdown(load(cfg.trace_file), since_ns=began_ns)
        echo("\n".join(format_table(result["ttft_breakdown"])))
    if cfg.out:
        out = Path(cfg.out)
        write_result(out, result, tool="tandem.bench.serve")
        echo(f"results: {out}")
        if cfg.plot:
            for p in _plots(cfg, runs, out):
                if p is not None:
                    echo(f"plot: {p}")
    return result


def _plots(cfg: ServeConfig, runs: list[RateRun] | list[ProfileRun], out: Path) -> list[Path | None]:
    label = cfg.label or cfg.backend
    if cfg.load_profile:   # one run: its CDFs and its timeline
        (run,) = runs
        return [plots.plot_cdfs({label: cdf_values(run.records)}, out.with_suffix(".cdf.png"),
                                title=f"{label}: latency CDFs"),
                plots.plot_timeline({label: run.series}, out.with_suffix(".profile.png"),
                                    title=f"{label}: load profile {cfg.load_profile}")]
    return [plots.plot_cdfs({f"{label} @ {plots.rate_label(r.request_rate)}": cdf_values(r.records) for r in runs},
                            out.with_suffix(".cdf.png"), title=f"{label}: latency CDFs"),
            plots.plot_vs_rate({label: [(r.request_rate, r.metrics.to_dict()) for r in runs]},
                               out.with_suffix(".rates.png"), title=f"{label}: vs request rate")]


def cdf_values(records: Sequence[dict]) -> dict[str, list[float]]:
    ok = [r for r in records if r["success"]]
    return {
        "TTFT": [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None],
        "TPOT": [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None],
        "ITL": [x for r in ok for x in r["itl_ms"]],
        "E2E": [r["e2e_ms"] for r in ok],
    }


def config_dict(cfg) -> dict:
    d = dataclasses.asdict(cfg)
    if "request_rates" in d:
        d["request_rates"] = [plots.rate_label(r) for r in cfg.request_rates]
    if d.get("load_profile") is not None:
        d["load_profile"] = str(cfg.load_profile)
    d["slo"] = str(cfg.slo)
    return d


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_gib, "load_avg_1_5_15m": load,
            "python": platform.python_version(), "platform": platform.platform()}

