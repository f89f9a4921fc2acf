"""What tracing costs: TTFT and TPOT of the same 1P1D stack with tracing off and on, at 2 req/s.

    python -m tandem.bench.tracing_overhead --model smollm2-135m [--rounds 2] [--num-prompts 200] \
        [--out bench/results/tracing_overhead.json]

Each round starts `tandem up` twice, once plain and once with `--otlp-traces-endpoint file://...`
(every span of every request exported: the most work tracing can do; a collector adds only its
network send, on the exporter's own thread), and runs `tandem bench serve` through the gateway at
`--request-rate` against each. Rounds alternate which mode goes first (off, on | on, off | ...): drift
and whatever favours the second run of a pair (a warmer page cache, a quieter box) hit both alike.
The JSON holds every run's TTFT/TPOT p50/p99 (ms), their medians per mode, and on/off - 1 per
statistic, to hold against the target (<= 2%). Each run also records the CPU seconds every process of
the stack (router, gateway, workers, Redis) spent while `bench serve` ran, and from them the CPU
milliseconds per request: the work tracing adds, measured directly, where latency percentiles of one
fresh stack against another carry the box's run-to-run spread. The stack's CPU seconds carry it too
(a slower step costs more CPU), so `--py-spy` samples every Python process of the stack while `bench
serve` runs (py-spy, non-blocking, idle threads left out) and counts the samples inside tracing code
(the OpenTelemetry SDK, services/common/tracing.py, services/worker/trace.py): the share of each
process's busy time that tracing takes, and the CPU milliseconds per request it amounts to. Profiled
runs are for that share, not for latency (py-spy takes CPU too). A smoke run: `--num-prompts 8 --rounds 1`.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.flags import add_load_flags, add_out_flag, add_stack_flags
from tandem.bench.results import write_result
from tandem.bench.serve.procs import start_tandem_up
from tandem.bench.serve.sweep import first_http_model

STATS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "cpu_ms_per_request")
WARMUPS = 2
# py-spy names files relative to sys.path: "(opentelemetry/sdk/trace/__init__.py:1100)"
TRACING_CODE = ("(opentelemetry/", "/opentelemetry/", "services/common/tracing.py", "services/worker/trace.py")


def run_order(rounds: int) -> list[bool]:
    """Whether each run is traced: pairs of off/on, the first of a pair alternating (ABBA)."""
    return [(i % 2 == 1) != (i // 2 % 2 == 1) for i in range(rounds * 2)]


def role(argv: list[str], name: str) -> str:
    """What a process of the stack is, from its command line: `tandem.cli worker --role prefill` is
    "worker:prefill", `tandem.cli router` "router", `-m tandem.services.gateway` "gateway", else its name."""
    if "tandem.services.gateway" in argv:
        return "gateway"
    if "tandem.cli" in argv and argv.index("tandem.cli") + 1 < len(argv):
        sub = argv[argv.index("tandem.cli") + 1]
        if "--role" in argv[:-1]:
            return f"{sub}:{argv[argv.index('--role') + 1]}"
        return sub
    return name


def stack_cpu(leader: int) -> dict[str, float]:
    """CPU seconds (user + system) each process of the stack under `leader` has used so far, by role."""
    import psutil

    out: dict[str, float] = {}
    top = psutil.Process(leader)
    for proc in [top, *top.children(recursive=True)]:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                key = role(proc.cmdline(), proc.name())
        except psutil.NoSuchProcess:
            continue
        out[key] = out.get(key, 0.0) + t.user + t.system
    return out


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Seconds per role between two `stack_cpu` samples (a role that appeared in between counts whole)."""
    return {k: round(after[k] - before.get(k, 0.0), 3) for k in sorted(after)}


def tracing_samples(raw: str) -> tuple[int, int]:
    """(samples with a tracing-code frame, all samples) in a py-spy `--format raw` profile: one
    `frame;frame;... count` line per distinct stack."""
    hit = total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        if any(code in stack for code in TRACING_CODE):
            hit += int(count)
    return hit, total


class Profilers:
    """py-spy on every Python process under `leader` (the workers, router and gateway) until `stop`."""

    def __init__(self, leader: int, out_dir: Path, index: int, rate: int):
        import psutil

        exe = Path(sys.executable).with_name("py-spy")
        exe = str(exe) if exe.exists() else shutil.which("py-spy")
        if exe is None:
            raise RuntimeError("--py-spy: py-spy is not installed (make install puts it in .venv)")
        self.rate, self.runs = rate, []
        for proc in psutil.Process(leader).children(recursive=True):
            if not proc.name().startswith("python"):
                continue
            name = role(proc.cmdline(), proc.name())
            out = out_dir / f"profile-{index}-{name.replace(':', '-')}.txt"
            self.runs.append((name, out, subprocess.Popen(
                [exe, "record", "--pid", str(proc.pid), "--format", "raw", "--nonblocking", "--rate", str(rate),
                 "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))

    def stop(self, requests: int) -> dict[str, dict]:
        """Per role: samples, those in tracing code, their share, and the CPU ms per request they make."""
        for _, _, p in self.runs:
            p.send_signal(signal.SIGINT)   # py-spy writes its profile on SIGINT
        out = {}
        for name, path, p in self.runs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            hit, total = tracing_samples(path.read_text()) if path.exists() else (0, 0)
            out[name] = {"samples": total, "tracing_samples": hit, "tracing_share": hit / total if total else 0.0,
                         "tracing_cpu_ms_per_request": 1e3 * hit / self.rate / max(requests, 1)}
        return out


def one_run(args: argparse.Namespace, traced: bool, workdir: Path, index: int) -> dict:
    up = ["--model", args.model, "--prefill", "1", "--decode", "1", "--port", "0", "--gateway-port", "0",
          "--quiet", *shlex.split(args.up_args)]
    trace_file = workdir / f"traces-{index}.jsonl"
    if traced:
        up += ["--otlp-traces-endpoint", f"file://{trace_file}"]
    proc, info = start_tandem_up(up, timeout_s=args.start_timeout)
    profilers = profile = None
    try:
        from tandem.cli.main import main as tandem

        out = workdir / f"run-{index}.json"
        name = first_http_model(info["gateway"]) or args.model
        if args.py_spy:
            profilers = Profilers(proc.proc.pid, workdir, index, args.py_spy_rate)
        cpu0, t0 = stack_cpu(proc.proc.pid), time.monotonic()
        rc = tandem(["bench", "serve", "--backend", "openai-http", "--base-url", info["gateway"],
                     "--model", args.model, "--served-model-name", name,
                     "--request-rate", str(args.request_rate), "--num-prompts", str(args.num_prompts),
                     "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                     "--num-warmups", str(WARMUPS), "--seed", str(args.seed), "--out", str(out), "--no-plot",
                     "--no-progress", "--no-save-requests"])
        cpu, wall = cpu_used(cpu0, stack_cpu(proc.proc.pid)), time.monotonic() - t0
        if rc != 0:
            raise RuntimeError(f"bench serve failed (rc {rc})")
        m = json.loads(out.read_text())["runs"][0]["metrics"]
        profile = profilers.stop(m["completed"] + WARMUPS) if profilers is not None else None
    finally:
        if profilers is not None and profile is None:
            profilers.stop(0)   # bench serve failed: no profiler outlives the run
        proc.stop_group()
    p = {k: m[k]["percentiles"] for k in ("ttft", "tpot")}
    return {"traced": traced, "completed": m["completed"], "failed": m["failed"],
            "ttft_p50": p["ttft"]["p50"], "ttft_p99": p["ttft"]["p99"],
            "tpot_p50": p["tpot"]["p50"], "tpot_p99": p["tpot"]["p99"],
            "cpu_ms_per_request": 1e3 * sum(cpu.values()) / (m["completed"] + WARMUPS),
            "cpu_cores_busy": sum(cpu.values()) / wall, "cpu_s": cpu,
            "spans": sum(1 for _ in trace_file.open()) if traced and trace_file.exists() else 0,
            **({"profile": profile} if profile is not None else {})}


def summary(runs: list[dict], target: float) -> dict:
    """Medians per mode and the relative cost on - off per statistic."""
    med = {mode: {s: statistics.median(r[s] for r in runs if r["traced"] == (mode == "on")) for s in STATS}
           for mode in ("off", "on")}
    overhead = {s: med["on"][s] / med["off"][s] - 1 for s in STATS if med["off"][s]}
    out = {"median": med, "overhead": overhead, "target": target,
           "met": all(v <= target for k, v in overhead.items() if k.endswith("p50"))}
    profiled = [r for r in runs if r["traced"] and r.get("profile")]
    if profiled:   # --py-spy: tracing code's CPU, all processes together, median over traced runs
        out["tracing_cpu"] = {
            "ms_per_request": statistics.median(
                sum(v["tracing_cpu_ms_per_request"] for v in r["profile"].values()) for r in profiled),
            "share_of_busy_cpu": statistics.median(
                sum(v["tracing_samples"] for v in r["profile"].values())
                / max(1, sum(v["samples"] for v in r["profile"].values())) for r in profiled)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.tracing_overhead", description=__doc__.split("\n\n")[0])
    add_stack_flags(p, model="smollm2-135m", up_args="",
                    helps={"up_args": "more `tandem up` flags, e.g. \"--dtype float32\""})
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs")
    add_load_flags(p, request_rate=2.0, num_prompts=200, input_len=512, output_len=128, seed=0)
    p.add_argument("--target", type=float, default=0.02, help="the p50 cost tracing may have")
    add_stack_flags(p, start_timeout=600.0)
    add_out_flag(p, "bench/results/tracing_overhead.json")
    p.add_argument("--keep-traces", metavar="DIR",
                   help="write the traced runs' span files (traces-N.jsonl) here and keep them, e.g. for "
                        "`python -m tandem.bench.trace_breakdown` (default: a temporary directory, removed)")
    p.add_argument("--py-spy", action="store_true",
                   help="profile the stack's Python processes with py-spy and report tracing code's share of "
                        "their CPU (profiled runs' latencies include py-spy's own cost)")
    p.add_argument("--py-spy-rate", type=int, default=100, help="py-spy samples per second")
    args = p.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory(prefix="tandem-tracing-") as tmp:
        traces = Path(args.keep_traces) if args.keep_traces else Path(tmp)
        traces.mkdir(parents=True, exist_ok=True)
        for i, traced in enumerate(run_order(args.rounds)):
            runs.append({"round": i // 2 + 1, **one_run(args, traced=traced, workdir=traces, index=i)})
            print(json.dumps(runs[-1]))
    result = {"config": vars(args), "runs": runs, **summary(runs, args.target)}
    write_result(args.out, result, tool="tandem.bench.tracing_overhead")
    for s, v in result["overhead"].items():
        print(f"{s}: off {result['median']['off'][s]:.2f} ms, on {result['median']['on'][s]:.2f} ms ({v:+.1%})")
    if "tracing_cpu" in result:
        t = result["tracing_cpu"]
        print(f"tracing code (py-spy): {t['ms_per_request']:.2f} CPU ms per request, "
              f"{t['share_of_busy_cpu']:.2%} of the stack's busy CPU")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
