"""Where a live worker's engine thread spends its time under serving load (py-spy, not a micro-benchmark).

    python -m tandem.bench.profile_serve --out bench/results/profile_serve.json

Starts `tandem up` (co-located by default), drives it with `tandem bench serve`'s workload (random
256-token prompts, 64 output tokens, Poisson 2 req/s), and samples the worker process with
`py-spy record --threads --nonblocking` meanwhile. Only the engine thread's samples are kept
(stacks through `services/worker/loop.py`); each is charged to the first frame that names a part
of the forward pass, reading from the leaf: attention, linear layers (incl. the vocab projection),
norms/RoPE/activation, sampling; the rest is scheduling, step metadata, detokenization, hand-offs and
the engine loop's own waiting. The JSON holds the shares and the raw top frames.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil

from tandem.bench.flags import add_load_flags, add_out_flag, add_stack_flags
from tandem.bench.results import write_result
from tandem.bench.serve.backends import BackendConfig
from tandem.bench.serve.datasets import DatasetConfig, load_tokenizer
from tandem.bench.serve.metrics import SLO
from tandem.bench.serve.serve import ServeConfig, machine_info, run_rates
from tandem.bench.serve.sweep import SweepConfig, TandemUp

# (category, path fragment of a frame's file): the first match from the leaf wins.
CATEGORIES = (
    ("attention", "engine/attention/"),
    ("linear", "torch/nn/modules/linear.py"),
    ("linear", "engine/models/prepack.py"),      # PackedLinear (prepacked oneDNN weights)
    ("linear", "engine/models/logits.py"),
    ("norm_rope_act", "engine/models/layers.py"),
    ("norm_rope_act", "engine/models/rope.py"),
    ("norm_rope_act", "torch/nn/functional.py"),  # F.silu (SDPA is a C call: its leaf is the backend)
    ("sampling", "engine/runner/sampler.py"),
    ("step_metadata", "engine/runner/model_runner.py"),
    ("scheduling", "engine/scheduler/"),
    ("detokenize_emit", "engine/tokenizer/detokenizer.py"),
    ("detokenize_emit", "engine/engine.py"),
)
ENGINE_THREAD_MARK = "services/worker/loop.py"


def classify(frames: list[str]) -> str:
    """`frames` root first (py-spy's collapsed order); returns the category of the innermost match."""
    for frame in reversed(frames):
        for name, fragment in CATEGORIES:
            if fragment in frame:
                return name
    return "other"


def summarize(raw: str) -> dict:
    """Shares of the engine thread's samples per category, from py-spy's `--format raw` output."""
    counts: collections.Counter[str] = collections.Counter()
    idle = 0
    leaves: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or ENGINE_THREAD_MARK not in stack:
            continue
        frames = stack.split(";")
        if "threading.py" in frames[-1]:      # the loop waiting for work or a wake-up
            idle += int(n)
            continue
        counts[classify(frames)] += int(n)
        leaves[frames[-1]] += int(n)
    busy = sum(counts.values())
    return {
        "engine_samples_busy": busy,
        "engine_samples_idle": idle,
        "busy_share_of_engine_thread": busy / max(1, busy + idle),
        "shares_of_busy": {k: v / max(1, busy) for k, v in counts.most_common()},
        "top_leaf_frames": leaves.most_common(15),
    }


def worker_pid(up_pid: int, role: str) -> int:
    for child in psutil.Process(up_pid).children(recursive=True):
        cmd = child.cmdline()
        if "tandem.cli" in cmd and role in cmd:
            return child.pid
    raise RuntimeError(f"no `tandem {role}` process under pid {up_pid}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="colocated", help="colocated, or a role of a disaggregated stack: decode | prefill")
    add_stack_flags(ap, up_args="")
    add_load_flags(ap, request_rate=2.0, num_prompts=48, input_len=256, output_len=64)
    ap.add_argument("--duration", type=int, default=20, help="seconds of sampling, from the first request")
    ap.add_argument("--rate-hz", type=int, default=50, help="py-spy samples per second")
    add_out_flag(ap, "bench/results/profile_serve.json")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("py-spy is not installed: `make install` installs it with the dev extras")

    mode_args = ["--mode", "colocated"] if args.mode == "colocated" else ["--prefill", "1", "--decode", "1"]
    up = TandemUp(args.mode, mode_args, SweepConfig(up_args=tuple(shlex.split(args.up_args))))
    endpoint = up.start()
    try:
        pid = worker_pid(up._proc.proc.pid, args.mode)
        dataset = DatasetConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
        cfg = ServeConfig(backend=endpoint.backend, backend_cfg=BackendConfig(endpoint.base_url, endpoint.model),
                          dataset=dataset, request_rates=(args.request_rate,), num_warmups=2, slo=SLO(2.0, 0.150),
                          progress=False, plot=False)
        with tempfile.TemporaryDirectory() as tmp:
            raw_path = Path(tmp) / "raw.txt"
            spy_cmd = [spy, "record", "-p", str(pid), "-d", str(args.duration), "-r", str(args.rate_hz), "-f", "raw",
                       "--threads", "--nonblocking", "-o", str(raw_path)]
            holder: dict = {}
            load = threading.Thread(target=lambda: holder.update(
                runs=asyncio.run(run_rates(cfg, load_tokenizer(cfg.tokenizer), echo=print))))
            load.start()
            subprocess.run(spy_cmd, check=True, capture_output=True)
            load.join()
            summary = summarize(raw_path.read_text())
    finally:
        up.close()
    m = holder["runs"][0].metrics
    serving = {"request_throughput": m.request_throughput, "goodput": m.goodput,
               "ttft_p50_ms": m.ttft.percentiles.get("p50"), "tpot_p50_ms": m.tpot.percentiles.get("p50")}
    result = {"bench": "profile_serve", "machine": machine_info(), "config": vars(args), "serving": serving,
              **summary}
    write_result(args.out, result, tool="tandem.bench.profile_serve")
    print(json.dumps({k: v for k, v in result.items() if k != "top_leaf_frames"}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
