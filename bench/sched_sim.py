"""Replay a serving workload through the real `Scheduler` on a simulated clock: what a scheduling
policy does to TTFT, ITL and goodput, a few seconds per point instead of minutes of serving.

    # 1. a real run that writes step traces (both workers of colocated-dp2):
    tandem bench sweep --deployments colocated-dp2 --request-rates 1,2 --num-prompts 128 \\
        --up-args="--step-trace-dir /tmp/steps" --out bench/results/real.json
    # 2. fit the step costs to it, check the simulation against the real run, then try policies:
    python -m tandem.bench.sched_sim --trace /tmp/steps --replay bench/results/real.json \\
        --config default= --config nomixed=--disable-mixed-chunk

What is real: the scheduler (engine/scheduler/, unchanged: admission, chunking, mixed-chunk budgets,
TTFT deadlines, priorities), the arrivals (the benchmark's own generator and seed, or the send times
recorded in a result with `--replay`), and the metrics (`bench.serve.metrics`, so ITL p99/p50 and
goodput mean what they mean in the sweep). What is modelled: a step takes `a + b·decode rows +
c·prefill tokens` seconds, fitted by least squares to the traces, times a factor drawn from the
fit's own residuals for that kind of step (the spread of a shared box: the other worker's memory
traffic, the HTTP path); the router sends each request to the worker with the least queued prefill
work, then the fewest requests, seeing it at once (the real router's view lags up to a heartbeat);
tokens arrive at the client when their step ends (in a traced dp2 run the client's ITL p50 and p99
were within 2% of those the workers' step times give).
Prompts never share a prefix. No forward pass runs and no token means anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result
from tandem.bench.serve.metrics import SLO, compute_metrics
from tandem.bench.serve.records import RequestRecord
from tandem.bench.serve.runner import arrival_offsets
from tandem.cli.engine_args import add_engine_arguments, engine_config_from_args
from tandem.engine.config import EngineConfig
from tandem.engine.outputs import FinishReason
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken, StepBatch
from tandem.engine.scheduler.prefill_order import tokens_to_prefill
from tandem.engine.scheduler.request import Request
from tandem.engine.scheduler.scheduler import Scheduler
from tandem.engine.scheduler.step_cost import StepCostModel

_KV_PAGES = 1 << 16     # ample: memory pressure (retraction) is not simulated


@dataclass(frozen=True)
class StepCosts:
    """Seconds per step: `(a + b·rows + c·prefill_tokens) × r`, r drawn from `decode_residuals` for a
    decode-only step and from `prefill_residuals` for one with prefill tokens (each (1.0,): no spread)."""

    a: float
    b: float
    c: float
    decode_residuals: tuple[float, ...] = (1.0,)
    prefill_residuals: tuple[float, ...] = (1.0,)

    def fitted(self, rows: int, prefill_tokens: int) -> float:
        return self.a + self.b * rows + self.c * prefill_tokens

    def draw(self, rows: int, prefill_tokens: int, rng: random.Random) -> float:
        spread = self.prefill_residuals if prefill_tokens else self.decode_residuals
        return self.fitted(rows, prefill_tokens) * rng.choice(spread)

    @classmethod
    def fit(cls, steps: Sequence[dict]) -> StepCosts:
        """Least squares over trace lines (`decode_tokens`, `prefill_tokens`, `seconds`)."""
        if len(steps) < 3:
            raise ValueError(f"need at least 3 traced steps to fit step costs, got {len(steps)}")
        model = StepCostModel(decay=1.0, ridge=1e-9)   # the scheduler's own fit, over the whole trace
        for s in steps:
            model.observe(s["prefill_tokens"], s["decode_tokens"], s["seconds"])
        coef = model.coefficients()
        if coef is None:
            raise ValueError("the traced steps do not determine the step costs (all of one shape?)")
        a, b, c = coef
        costs = cls(a, b, c)
        res = {True: [], False: []}
        for s in steps:
            f = costs.fitted(s["decode_tokens"], s["prefill_tokens"])
            if f > 0:
                res[s["prefill_tokens"] > 0].append(s["seconds"] / f)
        return cls(a, b, c, tuple(res[False]) or (1.0,), tuple(res[True]) or (1.0,))

    def describe(self) -> str:
        def q(xs: Sequence[float], p: float) -> float:
            return sorted(xs)[int(p * (len(xs) - 1))]
        d, p = self.decode_residuals, self.prefill_residuals
        return (f"a={self.a * 1e3:.2f} ms, b={self.b * 1e3:.2f} ms/row, c={self.c * 1e3:.3f} ms/prefill token; "
                f"spread (observed/fitted) p50/p99: decode {q(d, .5):.2f}/{q(d, .99):.2f}, "
                f"with prefill {q(p, .5):.2f}/{q(p, .99):.2f}")


def load_traces(paths: Iterable[str | Path]) -> list[dict]:
    """Trace lines from `--step-trace-dir` files, or every *.jsonl in the directories given."""
    steps = []
    for p in map(Path, paths):
        files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p] if p.is_file() else []
        if not files:
            raise ValueError(f"no step traces (*.jsonl) in {p}")
        for f in files:
            steps += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return steps


def simulate(cfg: EngineConfig, arrivals: Sequence[float], input_len: int, output_len: int, workers: int,
             costs: StepCosts, seed: int = 0) -> tuple[list[RequestRecord], float]:
    """Serve one request per arrival (s from the start) on `workers` schedulers; returns the client-side
    records and the window (first send to last token), as the sweep measures them."""
    now = [0.0]
    scheds = [Scheduler(cfg, _KV_PAGES, input_len + output_len + 1, clock=lambda: now[0]) for _ in range(workers)]
    running: list[tuple[float, StepBatch, float] | None] = [None] * workers  # (end, batch, seconds) in flight
    rng, spread = random.Random(seed), random.Random(seed + 1)
    records: dict[str, RequestRecord] = {}
    pending = sorted(arrivals)
    nxt = 0
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    while True:
        ends = [r[0] for r in running if r is not None]
        t = min([*ends, pending[nxt] if nxt < len(pending) else math.inf])
        if t == math.inf:
            break
        now[0] = t
        while nxt < len(pending) and pending[nxt] <= t:
            rid = f"r{nxt}"
            req = Request(rid, [rng.randrange(1, 1 << 30) for _ in range(input_len)], params, arrival=pending[nxt])
            records[rid] = RequestRecord(input_len, output_len, start=pending[nxt])
            min(scheds, key=_load).add(req)
            nxt += 1
        for w, s in enumerate(scheds):
            if running[w] is not None and running[w][0] <= t:
                _, batch, seconds = running[w]
                running[w] = None
                for req, _tok in s.on_step_done(batch, [SampledToken(1)] * len(batch.sampling), elapsed_s=seconds):
                    rec = records[req.rid]
                    rec.token_times.append(t)
                    if len(req.output_ids) >= output_len:
                        s.finish(req, FinishReason.LENGTH)
                        rec.end, rec.output_tokens, rec.success = t, len(req.output_ids), True
            if running[w] is None and s.has_work():
                batch = s.schedule()
                if batch is not None:
                    rows = sum(1 for q in batch.seqs if q.decode)
                    seconds = costs.draw(rows, batch.num_tokens - rows, spread)
                    running[w] = (t + seconds, batch, seconds)
    for s in scheds:
        s.check_idle()
    recs = list(records.values())
    return recs, max(r.end for r in recs) - min(r.start for r in recs)


def _load(s: Scheduler) -> tuple[int, int]:
    # The router's least-load key (services/router/policy.py): queued prefill tokens, then requests.
    return tokens_to_prefill(s.prefilling, s.waiting), len(s.waiting) + len(s.prefilling) + len(s.running)


def engine_config(flags: str) -> EngineConfig:
    p = argparse.ArgumentParser(prog="--config", add_help=False, exit_on_error=False)
    add_engine_arguments(p)
    try:
        return engine_config_from_args(p.parse_args(shlex.split(flags)))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"bad engine flags {flags!r}: {e}") from None


def recorded_runs(path: str | Path) -> dict[str, dict]:
    """Per request rate, the run a `tandem bench` result recorded (its first deployment): its
    `requests` (send times in `sent_ms`) and measured `metrics`."""
    d = json.loads(Path(path).read_text())
    return {str(r["request_rate"]): r for r in next(iter(d["deployments"].values()))["runs"]}


def summary(m: dict) -> dict:
    """The numbers compared, from `BenchMetrics.to_dict()` (simulated or as a result file has them)."""
    return {"itl_p50_ms": m["itl"]["percentiles"]["p50"], "itl_p99_ms": m["itl"]["percentiles"]["p99"],
            "itl_p99_over_p50": m["itl_p99_over_p50"], "ttft_p50_ms": m["ttft"]["percentiles"]["p50"],
            "ttft_max_ms": m["ttft"]["max"], "good": m["good_requests"], "completed": m["completed"],
            "goodput": m["goodput"]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.sched_sim", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", nargs="+", help="step traces (--step-trace-dir folders or .jsonl files) to fit")
    src.add_argument("--step-cost", help="a,b,c in ms instead of a fit (no spread)")
    p.add_argument("--no-spread", action="store_true",
                   help="keep the fitted costs but drop their spread: every step takes its fitted time")
    p.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS",
                   help="a scheduler to simulate: engine flags as `tandem up` takes them (repeat; default: default=)")
    p.add_argument("--replay", help="a `tandem bench` result: use its send times and show its measured numbers")
    p.add_argument("--workers", type=int, default=2, help="co-located workers (colocated-dp2: 2)")
    p.add_argument("--request-rates", default="1,2")
    p.add_argument("--seeds", default="0,1", help="arrival seeds, as `tandem bench --seed`")
    add_load_flags(p, num_prompts=128, input_len=256, output_len=64, slo="ttft=2s,tpot=150ms",
                   helps={"num_prompts": "requests per point (rate and seed)"})
    add_out_flag(p, help="write every point as JSON here")
    args = p.parse_args(argv)
    try:
        if args.trace:
            costs = StepCosts.fit(load_traces(args.trace))
            if args.no_spread:
                costs = StepCosts(costs.a, costs.b, costs.c)
        else:
            a, b, c = (float(x) / 1e3 for x in args.step_cost.split(","))
            costs = StepCosts(a, b, c)
        configs = {name: engine_config(flags) for name, _, flags in
                   (c.partition("=") for c in args.config or ["default="])}
        slo = SLO.parse(args.slo)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"step costs: {costs.describe()}")
    if args.replay:
        real_runs = recorded_runs(args.replay)
        points = [(rate, f"replay:{Path(args.replay).name}", [q["sent_ms"] / 1e3 for q in run["requests"]])
                  for rate, run in real_runs.items()]
    else:
        real_runs = {}
        points = [(rate, f"seed {seed}", arrival_offsets(args.num_prompts, float(rate), 1.0, random.Random(seed)))
                  for rate in args.request_rates.split(",") for seed in map(int, args.seeds.split(","))]
    rows = []
    for rate, arrivals_from, times in points:
        if rate in real_runs:
            rows.append({"config": "measured", "rate": rate, "arrivals": arrivals_from,
                         **summary(real_runs[rate]["metrics"])})
        for name, cfg in configs.items():
            recs, window = simulate(cfg, times, args.input_len, args.output_len, args.workers, costs)
            rows.append({"config": name, "rate": rate, "arrivals": arrivals_from,
                         **summary(compute_metrics(recs, window, slo).to_dict())})
    _print(rows)
    if args.out:
        write_result(args.out, {"args": vars(args),
                                "step_costs": dataclasses.asdict(costs) | {"describe": costs.describe()},
                                "points": rows}, tool="tandem.bench.sched_sim")
    return 0


def _print(rows: list[dict]) -> None:
    print(f"{'config':<22} {'rate':>4} {'arrivals':<26} {'ITL p50':>8} {'p99':>7} {'p99/p50':>7} "
          f"{'TTFT p50':>8} {'max':>6} {'good':>7} {'goodput':>7}")
    for r in rows:
        print(f"{r['config']:<22} {r['rate']:>4} {r['arrivals']:<26} {r['itl_p50_ms']:>8.1f} {r['itl_p99_ms']:>7.1f} "
              f"{r['itl_p99_over_p50']:>7.2f} {r['ttft_p50_ms']:>8.0f} {r['ttft_max_ms']:>6.0f} "
              f"{r['good']:>3}/{r['completed']:<3} {r['goodput']:>7.3f}")


if __name__ == "__main__":
    sys.exit(main())
