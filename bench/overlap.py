"""Overlap scheduling: the time the model waits for the CPU between forward passes, with and without.

    python -m tandem.bench.overlap --out bench/results/overlap.json
    python -m tandem.bench.overlap --batches 8,32 --input-len 256 --output-len 64 --num-threads 1

For each batch size one engine per mode serves the same greedy requests (arriving together, prompts
of `--input-len`, `--output-len` tokens each, so most steps are decode steps of the full batch) and
the forward thread's spans are read back: the gap is the time from the end of one forward pass (with
sampling) to the start of the next — scheduling, input building, result processing and
detokenization without overlap; only what could not be hidden with it. Greedy tokens are compared
across the modes (they must be equal). Runs in one process; `--num-threads 1` mimics a worker pinned
to one core by `tandem up`.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time

import torch

from tandem.bench.engine import prompts_of
from tandem.bench.flags import add_load_flags, add_out_flag, add_stack_flags
from tandem.bench.results import write_result
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams


def run_mode(cfg: EngineConfig, batch: int, input_len: int, output_len: int) -> dict:
    engine = LLMEngine(cfg)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    engine.generate(prompts_of(2, 16, engine.model_config.vocab_size, seed=1), params)   # warm-up
    prompts = prompts_of(batch, input_len, engine.model_config.vocab_size, seed=batch)
    engine.runner.forward_spans.clear()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    spans = list(engine.runner.forward_spans)
    engine.check_idle()
    engine.close()
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
    busy = sum(e - s for s, e in spans)
    return {
        "overlap": engine.overlap,
        "steps": len(spans),
        "overlapped_steps": engine.num_overlapped_steps,
        "wall_s": wall,
        "output_tok_s": batch * output_len / wall,
        "gap_ms_mean": 1e3 * statistics.fmean(gaps),
        "gap_ms_p50": 1e3 * statistics.median(gaps),
        "gap_ms_p90": 1e3 * statistics.quantiles(gaps, n=10)[-1],
        "forward_ms_mean": 1e3 * busy / len(spans),
        "model_busy_pct": 100.0 * busy / wall,
        "tokens": [o.token_ids for o in out],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_flags(ap, model="smollm2-135m", helps={"model": "model alias or folder"})
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default: %(default)s)")
    add_load_flags(ap, input_len=256, output_len=64)
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_out_flag(ap, "bench/results/overlap.json", help="JSON output")
    args = ap.parse_args()
    base = EngineConfig(model=args.model, num_threads=args.num_threads)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        modes = {}
        for overlap in (False, True):
            modes[overlap] = run_mode(dataclasses.replace(base, enable_overlap_schedule=overlap),
                                      batch, args.input_len, args.output_len)
        same = modes[False].pop("tokens") == modes[True].pop("tokens")
        rows.append({"batch": batch, "same_tokens": same, "off": modes[False], "on": modes[True]})
        off, on = modes[False], modes[True]
        print(f"batch {batch:3d}: gap p50 {off['gap_ms_p50']:.2f} -> {on['gap_ms_p50']:.2f} ms, "
              f"forward {off['forward_ms_mean']:.1f} -> {on['forward_ms_mean']:.1f} ms, "
              f"{off['output_tok_s']:.1f} -> {on['output_tok_s']:.1f} tok/s, same tokens: {same}", flush=True)
    write_result(args.out, {
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "config": vars(args), "rows": rows}, tool="tandem.bench.overlap")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
