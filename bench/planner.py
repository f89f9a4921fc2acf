"""`python -m tandem.bench.planner`: the SLO planner against the best fixed shapes on one load profile.

Every deployment gets the same trace (`tandem bench serve --load-profile`, same seed: the same
arrival times and prompts) and is started, measured and stopped alone (bench/serve/deployment.py).
While it runs, its shape is sampled every `sample_s` from the router's `tandem_router_workers{role}`
gauge (the router metrics port of `tandem up`'s READY JSON). Deployments (`--deployments`, comma
separated):
    1p1d           `tandem up --prefill 1 --decode 1` (any NpMd; sweep.py's names)
    colocated-dp2  `tandem up --mode colocated --colocated 2` (any colocated-dpN)
    planner        `tandem up --prefill 1 --decode 1 --planner --ttft-slo T --itl-slo I`, T and I from --slo
    NAME=ARGS      `tandem up ARGS` (quote it), e.g. "p2=--prefill 1 --decode 1 --planner --ttft-slo 1"
A deployment whose `tandem up` arguments include --planner is judged as a planner; the others are
the fixed shapes it is compared with (bench/planner_report.py: the verdict against the targets).

Output: JSON (per deployment: overall and per-phase metrics, failures, the time series, the shape
samples) and a PNG beside it (load, shape and goodput over time). Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import shlex
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench.flags import add_load_flags, add_out_flag, add_progress_flags, add_stack_flags
from tandem.bench.planner_report import format_summary, verdict
from tandem.bench.results import write_result
from tandem.bench.serve import plots
from tandem.bench.serve.backends import BackendConfig
from tandem.bench.serve.datasets import DatasetConfig, load_tokenizer
from tandem.bench.serve.deployment import Deployment, measure_deployment
from tandem.bench.serve.load_profile import LoadProfile, parse_load_profile
from tandem.bench.serve.metrics import SLO
from tandem.bench.serve.serve import ServeConfig, config_dict, machine_info, run_profile
from tandem.bench.serve.sweep import SweepConfig, TandemUp, _terminate_as_exit, make_deployment

log = logging.getLogger(__name__)

# A ramp 0.5 -> 3 -> 1 req/s and a mix change, short prompt / long output -> long prompt / short output.
DEFAULT_PROFILE = "chat=90s@0.5:128/256,burst=120s@3:256/64,long-prompt=90s@1:1024/32"
DEFAULT_DEPLOYMENTS = ("1p1d", "colocated-dp2", "planner")
ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class PlannerBenchConfig:
    model: str = "smollm2-135m"
    profile: LoadProfile = field(default_factory=lambda: parse_load_profile(DEFAULT_PROFILE))
    deployments: tuple[str, ...] = DEFAULT_DEPLOYMENTS
    slo: SLO = field(default_factory=lambda: SLO(ttft=2.0, tpot=0.150))
    seed: int = 0
    burstiness: float = 1.0
    range_ratio: float = 0.0
    max_concurrency: int | None = None
    num_warmups: int = 2
    sample_s: float = 2.0                 # shape sampling period
    window_s: float = 5.0                 # time-series window
    tandem_backend: str = "openai-http"   # through `tandem up`'s gateway, or the router's gRPC API
    dtype: str = "auto"
    up_args: tuple[str, ...] = ()         # extra `tandem up` flags for every deployment
    start_timeout_s: float = 600.0
    out: str = "bench/results/planner.json"
    progress: bool = True
    save_requests: bool = True

    def planner_args(self) -> list[str]:
        """`--planner` with the SLO the benchmark counts goodput with (its TTFT and TPOT bounds)."""
        out = ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--planner"]
        if self.slo.ttft is not None:
            out += ["--ttft-slo", f"{self.slo.ttft:g}"]
        if self.slo.tpot is not None:
            out += ["--itl-slo", f"{self.slo.tpot:g}"]
        return out


def make_deployments(cfg: PlannerBenchConfig) -> list[Deployment]:
    sweep_cfg = SweepConfig(model=cfg.model, tandem_backend=cfg.tandem_backend, dtype=cfg.dtype, up_args=cfg.up_args,
                            start_timeout_s=cfg.start_timeout_s)
    out: list[Deployment] = []
    for spec in cfg.deployments:
        name, sep, args = spec.partition("=")
        name = name.strip()
        if sep:
            out.append(TandemUp(name, shlex.split(args), sweep_cfg))
        elif name == "planner":
            out.append(TandemUp(name, cfg.planner_args(), sweep_cfg))
        else:
            out.append(make_deployment(name, sweep_cfg))
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise ValueError(f"deployment names must differ, got {names}")
    for dep in out:
        if is_planner(dep) and "--planner-decision-log" not in dep.mode_args:
            dep.mode_args = [*dep.mode_args, "--planner-decision-log", str(decision_log_path(cfg, dep.name))]
    return out


def decision_log_path(cfg: PlannerBenchConfig, name: str) -> Path:
    """Where a planner deployment's decisions go (JSON lines beside the results JSON)."""
    out = Path(cfg.out).resolve()
    return out.with_name(f"{out.stem}.{name}.decisions.jsonl")


def read_decisions(path: Path, wall0: float) -> list[dict]:
    """The planner's decisions from its log, each with `t_s` (seconds since the run's start); the
    candidates' scores are left out of all but reshapes (the log keeps them all)."""
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            d = json.loads(line)["planner"]
        except (ValueError, KeyError, TypeError):
            continue
        keep = {k: d.get(k) for k in ("current", "desired", "action", "reason")}
        if d.get("action") == "reshape":
            keep["scores"] = d.get("scores")
        out.append({"t_s": round(float(d.get("t", wall0)) - wall0, 1), **keep})
    return out


def split_deployments(text: str) -> tuple[str, ...]:
    """Comma separated, or semicolon separated when a NAME=ARGS entry needs commas (`--cpu-cores 0,1`)."""
    sep = ";" if ";" in text else ","
    return tuple(d.strip() for d in text.split(sep) if d.strip())


def is_planner(dep: Deployment) -> bool:
    return "--planner" in getattr(dep, "mode_args", ())


# ---- the shape, sampled from the router ----------------------------------------------------------

_WORKERS = re.compile(r'^tandem_router_workers\{role="(\w+)"\}\s+([0-9.eE+-]+)\s*$', re.M)


def parse_workers(metrics_text: str) -> dict[str, int]:
    """Registered workers by role from the router's Prometheus text."""
    counts = dict.fromkeys(ROLES, 0)
    for role, value in _WORKERS.findall(metrics_text):
        counts[role] = int(float(value))
    return counts


def shape_label(counts: dict[str, int]) -> str:
    """1P1D, 0P2D, 2C (co-located), ..."""
    parts = []
    if counts.get("prefill") or counts.get("decode"):
        parts.append(f"{counts.get('prefill', 0)}P{counts.get('decode', 0)}D")
    if counts.get("colocated"):
        parts.append(f"{counts['colocated']}C")
    return "+".join(parts) or "none"


class ShapeSampler:
    """Reads the router's worker gauges every `period_s` on a thread; `stop()` returns the samples:
    {"t": perf_counter, role: count..., "shape"} (or {"t", "error"} when the router did not answer)."""

    def __init__(self, url: str, period_s: float = 2.0, fetch: Callable[[str], str] | None = None):
        self.url, self.period_s = url, period_s
        self.fetch = fetch or _http_get
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shape-sampler", daemon=True)

    def start(self) -> ShapeSampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(10)
        self._sample()          # the shape at the end
        return self.samples

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period_s)

    def _sample(self) -> None:
        t = time.perf_counter()
        try:
            counts = parse_workers(self.fetch(self.url))
        except OSError as e:
            self.samples.append({"t": t, "error": f"{type(e).__name__}: {e}"})
            return
        self.samples.append({"t": t, **counts, "shape": shape_label(counts)})


def _http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.read().decode()


def router_metrics_url(dep: Deployment) -> str | None:
    """Where the deployment's router serves its metrics: `router_metrics_url`, else `tandem up`'s READY JSON."""
    url = getattr(dep, "router_metrics_url", None)
    if url:
        return url
    port = getattr(dep, "info", {}).get("router_metrics_port")
    return None if port is None else f"http://127.0.0.1:{port}/metrics"


# ---- the run -------------------------------------------------------------------------------------

def run_planner_bench(cfg: PlannerBenchConfig, deployments: Sequence[Deployment] | None = None,
                      echo=print, tokenizer=None) -> dict:
    deployments = list(deployments) if deployments is not None else make_deployments(cfg)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
    results: dict = {"tool": "bench/planner.py", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "machine": machine_info(), "config": config_dict(cfg), "load_profile": str(cfg.profile),
                     "profile_phases": cfg.profile.names(), "planners": [d.name for d in deployments if is_planner(d)],
                     "deployments": {}, "skipped": {}}
    out = Path(cfg.out)
    with _terminate_as_exit():
        for dep in deployments:
            entry, why = measure_deployment(dep, lambda ep, dep=dep: _measure(cfg, dep, ep, tokenizer, echo), echo)
            if entry is None:
                results["skipped"][dep.name] = why
            else:
                results["deployments"][dep.name] = entry
            # after each deployment: a later crash keeps what was measured
            write_result(out, results, tool="tandem.bench.planner")
    results["verdict"] = verdict(results)
    write_result(out, results, tool="tandem.bench.planner")
    echo(format_summary(results))
    echo(f"results: {out}")
    series = {n: e["time_series"] for n, e in results["deployments"].items()}
    shapes = {n: e["shape"] for n, e in results["deployments"].items() if e["shape"]}
    png = plots.plot_timeline(series, out.with_suffix(".png"), shapes=shapes or None,
                              title=f"load profile {cfg.profile} ({cfg.slo.describe()})")
    if png is not None:
        echo(f"plot: {png}")
    return results


def _measure(cfg: PlannerBenchConfig, dep: Deployment, ep, tokenizer, echo) -> dict:
    serve_cfg = ServeConfig(
        backend=ep.backend,
        backend_cfg=BackendConfig(base_url=ep.base_url, model=ep.model, force_output_len=ep.force_output_len),
        dataset=DatasetConfig(seed=cfg.seed, range_ratio=cfg.range_ratio), burstiness=cfg.burstiness,
        max_concurrency=cfg.max_concurrency, num_warmups=cfg.num_warmups, slo=cfg.slo, progress=cfg.progress,
        label=dep.name, load_profile=cfg.profile, window_s=cfg.window_s)
    url = router_metrics_url(dep)
    log_path = decision_log_path(cfg, dep.name) if is_planner(dep) else None
    if log_path is not None:
        log_path.unlink(missing_ok=True)
    sampler = ShapeSampler(url, cfg.sample_s).start() if url else None
    if sampler is None:
        echo(f"--- {dep.name}: no router metrics endpoint: its shape is not sampled")
    try:
        run = asyncio.run(run_profile(serve_cfg, tokenizer, echo))
    finally:
        samples = sampler.stop() if sampler is not None else []
    shape = [{**{k: v for k, v in s.items() if k != "t"}, "t_s": round(s["t"] - run.t0, 3)} for s in samples]
    d = run.to_dict(cfg.save_requests)
    wall0 = time.time() - (time.perf_counter() - run.t0)
    decisions = read_decisions(log_path, wall0) if log_path is not None else []
    return {"planner": is_planner(dep), "metrics": d["metrics"], "phases": d["phases"], "decisions": decisions,
            "time_series": d["time_series"], "shape": shape, "shapes_seen": sorted({s["shape"] for s in shape
                                                                                    if "shape" in s}),
            **({"requests": d["requests"]} if cfg.save_requests else {})}


# ---- command line --------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None = None) -> PlannerBenchConfig:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_flags(p, model="smollm2-135m", helps={"model": "the model every deployment serves (alias or HF folder)"})
    p.add_argument("--load-profile", default=DEFAULT_PROFILE, help="phases DURATION@RATE:IN/OUT,... or a JSON file")
    p.add_argument("--deployments", default=",".join(DEFAULT_DEPLOYMENTS),
                   help="comma (or semicolon) separated: NpMd, colocated-dpN, planner, or NAME=`tandem up` ARGS")
    add_load_flags(p, range_ratio=0.0, seed=0, burstiness=1.0, max_concurrency=None, num_warmups=2,
                   slo="ttft=2s,tpot=150ms", helps={
                       "seed": "seed of the arrivals and prompts (the same for every deployment)",
                       "num_warmups": "requests sent one by one before each run",
                       "slo": "goodput SLOs (also the planner deployment's --ttft-slo / --itl-slo)"})
    p.add_argument("--sample-interval", type=float, default=2.0, help="seconds between shape samples")
    p.add_argument("--load-profile-window", type=float, default=5.0, help="the time series' window (s)")
    p.add_argument("--tandem-backend", default="openai-http", choices=["openai-http", "tandem-grpc"])
    p.add_argument("--dtype", default="auto", help="`tandem up --dtype` of every deployment")
    add_stack_flags(p, up_args="", start_timeout=600.0,
                    helps={"up_args": "extra `tandem up` flags for every deployment"})
    add_out_flag(p, "bench/results/planner.json", help="results JSON (the PNG goes beside it)")
    add_progress_flags(p, save_requests=True)
    a = p.parse_args(argv)
    try:
        return PlannerBenchConfig(
            model=a.model, profile=parse_load_profile(a.load_profile),
            deployments=split_deployments(a.deployments), slo=SLO.parse(a.slo),
            seed=a.seed, burstiness=a.burstiness, range_ratio=a.range_ratio, max_concurrency=a.max_concurrency,
            num_warmups=a.num_warmups, sample_s=a.sample_interval, window_s=a.load_profile_window,
            tandem_backend=a.tandem_backend, dtype=a.dtype, up_args=tuple(shlex.split(a.up_args)),
            start_timeout_s=a.start_timeout, out=a.out, progress=not a.no_progress,
            save_requests=not a.no_save_requests)
    except ValueError as e:
        p.error(str(e))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    try:
        results = run_planner_bench(cfg)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if results["deployments"] else 1


if __name__ == "__main__":
    sys.exit(main())
