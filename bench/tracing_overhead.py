"""What tracing costs: TTFT and TPOT of the same 1P1D stack with tracing off and on, at 2 req/s.

    python -m bench.tracing_overhead --model smollm2-135m [--rounds 2] [--num-prompts 200] \
        [--out bench/results/tracing_overhead.json]

Each round starts `tandem up` twice, once plain and once with `--otlp-traces-endpoint file://...`
(every span of every request exported: the most work tracing can do; a collector adds only its
network send, on the exporter's own thread), and runs `tandem bench serve` through the gateway at
`--request-rate` against each. Rounds alternate which mode goes first (off, on | on, off | ...): drift
and whatever favours the second run of a pair (a warmer page cache, a quieter box) hit both alike.
The JSON holds every run's TTFT/TPOT p50/p99 (ms), their medians per mode, and on/off - 1 per
statistic, to hold against the target (<= 2%). A smoke run: `--num-prompts 8 --rounds 1`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.serve.procs import start_tandem_up
from bench.serve.sweep import first_http_model

STATS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


def run_order(rounds: int) -> list[bool]:
    """Whether each run is traced: pairs of off/on, the first of a pair alternating (ABBA)."""
    return [(i % 2 == 1) != (i // 2 % 2 == 1) for i in range(rounds * 2)]


def one_run(args: argparse.Namespace, traced: bool, workdir: Path, index: int) -> dict:
    up = ["--model", args.model, "--prefill", "1", "--decode", "1", "--port", "0", "--gateway-port", "0",
          "--quiet", *args.up_args.split()]
    trace_file = workdir / f"traces-{index}.jsonl"
    if traced:
        up += ["--otlp-traces-endpoint", f"file://{trace_file}"]
    proc, info = start_tandem_up(up, timeout_s=args.start_timeout)
    try:
        from tandem.cli import main as tandem

        out = workdir / f"run-{index}.json"
        name = first_http_model(info["gateway"]) or args.model
        rc = tandem(["bench", "serve", "--backend", "openai-http", "--base-url", info["gateway"],
                     "--model", args.model, "--served-model-name", name,
                     "--request-rate", str(args.request_rate), "--num-prompts", str(args.num_prompts),
                     "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                     "--num-warmups", "2", "--seed", str(args.seed), "--out", str(out), "--no-plot",
                     "--no-progress", "--no-save-requests"])
        if rc != 0:
            raise RuntimeError(f"bench serve failed (rc {rc})")
        m = json.loads(out.read_text())["runs"][0]["metrics"]
    finally:
        proc.stop_group()
    p = {k: m[k]["percentiles"] for k in ("ttft", "tpot")}
    return {"traced": traced, "completed": m["completed"], "failed": m["failed"],
            "ttft_p50": p["ttft"]["p50"], "ttft_p99": p["ttft"]["p99"],
            "tpot_p50": p["tpot"]["p50"], "tpot_p99": p["tpot"]["p99"],
            "spans": sum(1 for _ in trace_file.open()) if traced and trace_file.exists() else 0}


def summary(runs: list[dict], target: float) -> dict:
    """Medians per mode and the relative cost on - off per statistic."""
    med = {mode: {s: statistics.median(r[s] for r in runs if r["traced"] == (mode == "on")) for s in STATS}
           for mode in ("off", "on")}
    overhead = {s: med["on"][s] / med["off"][s] - 1 for s in STATS if med["off"][s]}
    return {"median": med, "overhead": overhead, "target": target,
            "met": all(v <= target for k, v in overhead.items() if k.endswith("p50"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tracing_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--up-args", default="", help="more `tandem up` flags, e.g. \"--dtype float32\"")
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.02, help="the p50 cost tracing may have")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", default="bench/results/tracing_overhead.json")
    p.add_argument("--keep-traces", metavar="DIR",
                   help="write the traced runs' span files (traces-N.jsonl) here and keep them, e.g. for "
                        "`python -m bench.trace_breakdown` (default: a temporary directory, removed)")
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="tandem-tracing-") as tmp:
        traces = Path(args.keep_traces) if args.keep_traces else Path(tmp)
        traces.mkdir(parents=True, exist_ok=True)
        for i, traced in enumerate(run_order(args.rounds)):
            runs.append({"round": i // 2 + 1, **one_run(args, traced=traced, workdir=traces, index=i)})
            print(json.dumps(runs[-1]))
    result = {"tool": "bench.tracing_overhead", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "config": vars(args), "runs": runs, **summary(runs, args.target)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for s, v in result["overhead"].items():
        print(f"{s}: off {result['median']['off'][s]:.2f} ms, on {result['median']['on'][s]:.2f} ms ({v:+.1%})")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
