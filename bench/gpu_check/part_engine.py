"""Part `engine`: the co-located engine on CUDA with CUDA graphs on and off.

1. Agreement: the tests' tiny Llama in fp32 (clear greedy winners), the same 7 prompts with graphs
   of sizes 1 and 4 and without graphs: identical tokens, while decode batches of 7..1 rows run as
   exact graphs, padded graphs and (above 4) eagerly.
2. Timing: a random-weight model of SmolLM2-135M's shape in bf16 (models.py), decode tokens/s at
   batch 1, 8, 32 and 64 (64-token prompts, 64 tokens out, ignore_eos) with graphs on (the CUDA
   default: every size up to max_running_requests captured) and off, measured as bench/engine.py
   does: only pure decode steps count, after one untimed run of the same shape. The graph engine
   must actually replay graphs there; how much faster it is gets reported, not asserted.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from tandem.bench.gpu_check.report import main_of, require

BATCHES = (1, 8, 32, 64)
INPUT_LEN, OUTPUT_LEN = 64, 64


def prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def agreement(tiny: Path, device: str) -> dict:
    from tandem.engine.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    base = EngineConfig(model=str(tiny), dtype="float32", device=device, page_size=4, max_total_tokens=2048,
                        max_running_requests=8)
    # Outputs end one after another: decode batches of 7, 6, 5 (eager: above 4), 4, then 3 and 2 (padded to 4), 1.
    ps = prompts([3, 9, 1, 17, 6, 30, 12], 512, seed=11)
    params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(ps))]
    eager = LLMEngine(dataclasses.replace(base, enable_graph=False))
    graphs = LLMEngine(dataclasses.replace(base, enable_graph=True, graph_bs=(1, 4)))
    runner = graphs.runner.graphs
    require(eager.runner.graphs is None, "graphs off, yet the engine has a graph runner")
    require(runner is not None, "graphs on, yet the engine captured none")
    kind = runner.kind
    expected = [r.token_ids for r in eager.generate(ps, params)]
    got = [r.token_ids for r in graphs.generate(ps, params)]
    out = {"kind": kind, "sizes": runner.sizes, "replays": runner.replays, "eager_decodes": runner.eager_decodes,
           "same_tokens": got == expected}
    if device == "cuda":
        require(kind == "cuda-graph", f"on CUDA the graph runner is {kind!r}, not CUDA graphs")
    require(runner.replays > 0, "no decode step replayed a graph")
    require(runner.eager_decodes > 0, "batches above the largest graph (5-7 rows) did not run eagerly")
    mismatched = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    require(not mismatched, f"graphs on and off disagree on prompts {mismatched}: "
            f"{[(got[i], expected[i]) for i in mismatched[:2]]}")
    for engine in (eager, graphs):
        engine.check_idle()
    return out


def timing(model: Path, device: str, batches=BATCHES, input_len=INPUT_LEN, output_len=OUTPUT_LEN,
           on_row=None) -> list[dict]:
    from tandem.bench.engine import bench_tandem_decode
    from tandem.engine.config import EngineConfig
    from tandem.engine.engine import LLMEngine

    cfg = EngineConfig(model=str(model), dtype="bfloat16", device=device, max_running_requests=max(batches),
                       max_total_tokens=max(batches) * (input_len + output_len + 32))
    rows = []
    for graphs_on in (False, True):
        t0 = time.perf_counter()
        engine = LLMEngine(dataclasses.replace(cfg, enable_graph=graphs_on))
        graphs = engine.runner.graphs
        require((graphs is not None) == graphs_on, f"enable_graph={graphs_on}, graph runner {graphs}")
        startup = {"startup_s": round(time.perf_counter() - t0, 2),
                   "capture_s": round(graphs.capture_s, 2) if graphs else None,
                   "sizes": graphs.sizes if graphs else None, "kind": graphs.kind if graphs else None,
                   "overlap": engine.overlap}
        for batch in batches:
            # The same run untimed first: Triton compiles the kernels of each batch's shapes on first use.
            bench_tandem_decode(engine, batch, input_len, output_len)
            before = graphs.replays if graphs else 0
            stats = bench_tandem_decode(engine, batch, input_len, output_len)
            row = {"graphs": "on" if graphs_on else "off", "batch": batch, **startup,
                   **{k: round(v, 3) for k, v in stats.items()},
                   "replays": (graphs.replays - before) if graphs else None}
            if graphs:
                require(row["replays"] > 0, f"batch {batch}: graphs on, yet no decode step replayed one")
            rows.append(row)
            if on_row is not None:
                on_row(row)
        engine.check_idle()
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def speedups(rows: list[dict]) -> dict:
    by = {(r["graphs"], r["batch"]): r["decode_tok_s"] for r in rows}
    return {b: round(by[("on", b)] / by[("off", b)], 2) for (g, b) in by if g == "on" and ("off", b) in by}


def run(report, args) -> None:
    from tandem.bench.gpu_check.models import SMOLLM2_SHAPE, make_random_llama
    from tests.fixtures.tiny_models import make_tiny_model

    device = args.device
    if device == "cuda":
        require(torch.cuda.is_available(), "torch sees no CUDA device")
    d = report.details
    with tempfile.TemporaryDirectory(prefix="gpu-check-models-") as tmp:
        tiny = make_tiny_model(Path(tmp) / "tiny", "llama")
        d["agreement"] = agreement(tiny, device)
        print(f"agreement: {d['agreement']}", flush=True)
        report.save()
        shape = dict(SMOLLM2_SHAPE, num_hidden_layers=args.layers) if args.layers else SMOLLM2_SHAPE
        t0 = time.perf_counter()
        model = make_random_llama(Path(tmp) / "smollm2-shape", shape)
        d["model"] = {"shape": shape, "dtype": "bfloat16", "weights": "random N(0, 0.02)",
                      "made_s": round(time.perf_counter() - t0, 1)}
        d["decode"] = []

        def on_row(row):
            d["decode"].append(row)
            print(f"graphs {row['graphs']:>3} batch {row['batch']:>3}: {row['decode_tok_s']:>10.1f} tok/s, "
                  f"step {row['step_ms_median']:.2f} ms (forward {row['forward_ms_median']:.2f} ms)", flush=True)
            report.save()

        batches = tuple(int(b) for b in args.batches.split(","))
        timing(model, device, batches, on_row=on_row)
        d["graph_speedup_by_batch"] = speedups(d["decode"])
        print(f"decode tokens/s, graphs on / off: {d['graph_speedup_by_batch']}", flush=True)


def add_args(p) -> None:
    p.add_argument("--device", default="cuda", help="cuda; cpu exercises the part without a GPU (inductor graphs)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--layers", type=int, default=0, help="fewer layers than SmolLM2's 30 (CPU exercise)")


if __name__ == "__main__":
    main_of(run, add_args)
