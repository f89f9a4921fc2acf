"""How much the same decode step varies on this machine with nothing else running: the floor under
any ITL p99/p50 a scheduler can reach here.

    python -m tandem.bench.step_noise --processes 1,2 --seconds 20 --out bench/results/step_noise.json

For each count N, N engine processes, each pinned to its own core with one thread, decode the same
number of rows for the same wall-clock window (no HTTP path, no scheduler decisions: the batch never
changes). Each step's time is compared with the median of the 21 steps around it (the context grows
during the run, so a global median would mix in that drift); the p90 and p99 of that ratio are the
noise. N = 2 adds what two workers sharing memory bandwidth do to each other (colocated-dp2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result

_WINDOW = 21


def spread(times: Sequence[float], window: int = _WINDOW) -> dict:
    """Median step (ms), and the p90/p99 of each step over the median of the `window` steps around it."""
    if len(times) < window:
        raise ValueError(f"need at least {window} steps, got {len(times)}")
    h = window // 2
    rel = sorted(t / statistics.median(times[max(0, i - h):i + h + 1]) for i, t in enumerate(times))
    n = len(rel)
    return {"steps": n, "p50_ms": round(statistics.median(times) * 1e3, 2),
            "p90": round(rel[int(0.9 * (n - 1))], 3), "p99": round(rel[int(0.99 * (n - 1))], 3),
            "max": round(rel[-1], 3)}


def _child(core: int, rows: int, start_at: float, seconds: float, prompt_len: int) -> None:
    os.sched_setaffinity(0, {core})
    import torch
    torch.set_num_threads(1)
    from tandem.bench.engine import prompts_of
    from tandem.engine.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(num_threads=1))
    budget = eng.context_len - prompt_len - 1
    for p in prompts_of(rows, prompt_len, eng.model_config.vocab_size, seed=core):
        eng.add_request(p, SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True))
    for _ in range(5):   # prefill, then a few decode steps to warm up
        eng.step()
    while time.time() < start_at:
        time.sleep(0.005)
    times = []
    while time.time() < start_at + seconds:
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    print("STEP_NOISE " + json.dumps({"core": core, **spread(times)}), flush=True)


def run(processes: int, rows: int, seconds: float, prompt_len: int, start_in: float = 30.0) -> list[dict]:
    """`processes` children on cores 0..N-1, all timing the same window (they load the model first)."""
    start_at = time.time() + start_in
    procs = [subprocess.Popen([sys.executable, "-P", "-m", "tandem.bench.step_noise", "--child", str(core), "--rows", str(rows),
                               "--start-at", str(start_at), "--seconds", str(seconds), "--input-len", str(prompt_len)],
                              stdout=subprocess.PIPE, text=True) for core in range(processes)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=start_in + seconds + 120)
        if p.returncode != 0:
            raise RuntimeError(f"step_noise child exited {p.returncode}")
        out += [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("STEP_NOISE ")]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.bench.step_noise", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--processes", default="1,2", help="engine processes at once, one per core (a list: one run each)")
    p.add_argument("--rows", type=int, default=2, help="decode rows per step")
    p.add_argument("--seconds", type=float, default=20.0, help="timed window per run")
    add_load_flags(p, input_len=256, helps={"input_len": "prompt tokens before decoding starts"})
    add_out_flag(p, help="write the results as JSON here")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        _child(args.child, args.rows, args.start_at, args.seconds, args.input_len)
        return 0
    counts = [int(x) for x in args.processes.split(",")]
    if max(counts) > len(os.sched_getaffinity(0)):
        print(f"error: {max(counts)} processes need as many cores; this machine has "
              f"{len(os.sched_getaffinity(0))}", file=sys.stderr)
        return 2
    results = []
    for n in counts:
        for r in run(n, args.rows, args.seconds, args.input_len):
            results.append({"processes": n, **r})
            print(f"{n} process(es), core {r['core']}: {r['steps']} steps of {args.rows} rows, median "
                  f"{r['p50_ms']} ms, step / local median p90 {r['p90']}, p99 {r['p99']}, max {r['max']}", flush=True)
    if args.out:
        write_result(args.out, {"args": vars(args), "runs": results}, tool="tandem.bench.step_noise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
