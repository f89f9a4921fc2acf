"""Engine throughput: prefill and decode tokens/s at several batch sizes, beside HF transformers.

    python -m tandem.bench.engine --model smollm2-135m --out bench/results/engine.json
    python -m tandem.bench.engine --batches 32 --input-lens 512 --mixed-requests 0   # the serving shape

Both run the same model, dtype and thread count in this one process, one after the other. HF runs
static-batch `generate` (equal-length prompts, so no padding). Decode throughput for HF is derived as
(generate(N tokens) - generate(1 token)) so both sides exclude the prefill.
The engine's decode step is split into model forward vs everything else (scheduling, metadata,
sampling, detokenization) to show the overhead the issue bounds at 10%.

Decode graphs (engine/runner/graph_runner.py): `--graph on|off` sets `--enable-graph`/`--disable-graph` for
the engine; `--compare-graph` builds a second engine with graphs on and measures each row on both,
back to back (the cores are shared, so only a ratio measured this way means much):

    python -m tandem.bench.engine --batches 1,8,32 --input-lens 512 --mixed-requests 0 --skip-hf --compare-graph

KV layout (engine/kvcache/kv_pool.py): `--compare-kv-layout` runs the first engine on a layer-first
pool and a second on a page-first one, row by row alternating (`page_first_speedup` > 1: page-first faster):

    python -m tandem.bench.engine --batches 1,8,32 --input-lens 512,2048 --mixed-requests 0 --skip-hf \
        --compare-kv-layout --repeat 3

Packed weights (engine/models/prepack.py): `--compare-prepack` does the same with the first engine on
plain weights (`--disable-weight-prepack`) and a second on packed ones, prefill included (in fp32: MKL
against Tandem's linear kernel):

    python -m tandem.bench.engine --dtype float32 --threads 1 --batches 1,8,32 --input-lens 256 --mixed-requests 0 \
        --skip-hf --compare-prepack --repeat 3

Prefill/extend attention (engine/hardware.py `choose_extend_attention`): `--compare-extend` runs a
second engine whose prefill/extend rows take the paged kernel whatever the CPU (`extend_kernel_*`; the
first runs the default: SDPA in bf16 on AMX):

    python -m tandem.bench.engine --threads 1 --batches 1,8 --input-lens 256,1024 --mixed-requests 0 --skip-hf \
        --compare-extend --repeat 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from tandem.bench.flags import add_load_flags, add_out_flag, add_stack_flags
from tandem.bench.results import write_result
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.hardware import Choice
from tandem.engine.sampling_params import SamplingParams


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (length,), generator=g).tolist() for _ in range(n)]


def bench_tandem_prefill(engine: LLMEngine, batch: int, input_len: int) -> float:
    prompts = prompts_of(batch, input_len, engine.model_config.vocab_size, seed=batch)
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return batch * input_len / (time.perf_counter() - t0)


def bench_tandem_decode(engine: LLMEngine, batch: int, input_len: int, output_len: int) -> dict:
    prompts = prompts_of(batch, input_len, engine.model_config.vocab_size, seed=1000 + batch)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    step_times, fwd_times, batch_sizes = [], [], []
    decoded = 0
    while engine.has_unfinished():
        is_decode = not engine.scheduler.waiting and not engine.scheduler.prefilling
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if is_decode:
            step_times.append(dt)
            fwd_times.append(engine.runner.last_timings.forward_s)
            decoded += len(outs)
            batch_sizes.append(len(outs))
    total = sum(step_times)
    return {
        "decode_tok_s": decoded / total,
        "step_ms_median": statistics.median(step_times) * 1e3,
        "forward_ms_median": statistics.median(fwd_times) * 1e3,
        "outside_forward_frac": 1 - sum(fwd_times) / total,
        "decode_batch_median": statistics.median(batch_sizes),
    }


def bench_hf(model, batch: int, input_len: int, output_len: int, vocab: int) -> dict:
    ids = torch.tensor(prompts_of(batch, input_len, vocab, seed=2000 + batch))
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t0

    t1 = gen(1)
    tn = gen(output_len)
    return {"prefill_tok_s": batch * input_len / t1, "decode_tok_s": batch * (output_len - 1) / (tn - t1)}


def mixed_workload(n: int, vocab: int, seed: int = 5) -> tuple[list[list[int]], list[int]]:
    """Prompts of 32..256 tokens and outputs of 16..128 tokens: what a server actually sees."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(32, 257, (n,), generator=g).tolist()
    outs = torch.randint(16, 129, (n,), generator=g).tolist()
    prompts = [torch.randint(100, vocab - 100, (n_,), generator=g).tolist() for n_ in lens]
    return prompts, outs


def bench_tandem_mixed(engine: LLMEngine, prompts, outs) -> dict:
    t0 = time.perf_counter()
    results = engine.generate(prompts, [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs])
    dt = time.perf_counter() - t0
    return {"output_tok_s": sum(len(r.token_ids) for r in results) / dt, "seconds": dt}


def bench_hf_mixed(model, prompts, outs, batch: int) -> dict:
    """Static batching as `generate` does it: left-pad each batch, run it to its longest output."""
    useful, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk, chunk_outs = prompts[i:i + batch], outs[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        n = max(chunk_outs)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        useful += sum(chunk_outs)
    dt = time.perf_counter() - t0
    return {"output_tok_s": useful / dt, "seconds": dt}


def _rss_mb() -> float:
    """This process's resident memory (MiB), after building an engine: compiled graphs hold their own
    (frozen, prepacked) copy of the weights."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    add_stack_flags(ap, model="smollm2-135m")
    ap.add_argument("--dtype", default="auto", help="auto: what engine/hardware.py picks for this CPU")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--input-lens", default="128,512",
                    help="prompt lengths; each gets a row per batch size (512: the serving workload's context)")
    add_load_flags(ap, output_len=64)
    ap.add_argument("--mixed-requests", type=int, default=64, help="requests in the mixed workload (0: skip)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--graph", choices=("auto", "on", "off"), default="auto",
                    help="decode graphs for the engine (auto: the engine's default for the device)")
    ap.add_argument("--compare-graph", action="store_true",
                    help="also run every decode row on a second engine with graphs on (the first: --graph off)")
    ap.add_argument("--graph-bs", default=None, help="with graphs on: the captured batch sizes (default: the engine's)")
    ap.add_argument("--compare-prepack", action="store_true",
                    help="also run every row on a second engine with packed weights (the first: plain weights)")
    ap.add_argument("--compare-kv-layout", action="store_true",
                    help="the first engine with a layer-first KV pool, a second with a page-first one (--kv-layout)")
    ap.add_argument("--compare-extend", action="store_true",
                    help="also run every row on a second engine whose prefill/extend attention is the paged kernel")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's default)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each row this many times (alternating engines with --compare-graph, "
                         "--compare-prepack, --compare-kv-layout or --compare-extend) and keep the fastest: on shared cores the best run is the least "
                         "disturbed one")
    add_out_flag(ap, "bench/results/engine.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    input_lens = [int(n) for n in args.input_lens.split(",")]

    max_batch = max(batches)
    graph = {"auto": None, "on": True, "off": False}["off" if args.compare_graph else args.graph]
    # No mixed chunks: every prompt is prefilled before decoding starts, so a decode row of batch b runs
    # b sequences (with them, the first admitted decode while the rest prefill, finish first, and the
    # pure decode steps measured run fewer than b).
    cfg = dataclasses.replace(EngineConfig(), model=args.model, dtype=args.dtype, enable_prefix_cache=False,
                              kv_cache_gb=2.0, chunked_prefill_size=8192, max_running_requests=max_batch,
                              enable_mixed_chunk=False, num_threads=args.threads or None,
                              enable_weight_prepack=False if args.compare_prepack else None,
                              enable_graph=graph, kv_layout="layer_first" if args.compare_kv_layout else "auto",
                              graph_bs=tuple(int(b) for b in args.graph_bs.split(",")) if args.graph_bs else None)
    engines = {"tandem": cfg}
    if args.compare_graph:
        engines["graph"] = dataclasses.replace(cfg, enable_graph=True)
    if args.compare_prepack:
        engines["prepack"] = dataclasses.replace(cfg, enable_weight_prepack=True)
    if args.compare_extend:
        engines["extend_kernel"] = cfg
    if args.compare_kv_layout:
        engines["page_first"] = dataclasses.replace(cfg, kv_layout="page_first")
    startup = {}
    for name, c in list(engines.items()):
        t0 = time.perf_counter()
        engines[name] = LLMEngine(c)
        if name == "extend_kernel":
            engines[name].runner.attn.extend_attention = "kernel"
            engines[name].runner.choices["extend attention"] = Choice("kernel", "--compare-extend")
        graphs = engines[name].runner.graphs
        startup[name] = {"engine_s": time.perf_counter() - t0, "graph_capture_s": graphs.capture_s if graphs else None,
                         "graph_bs": graphs.sizes if graphs else None, "rss_mb": _rss_mb()}
        print(name, json.dumps(startup[name]))
    engine = engines["tandem"]
    vocab = engine.model_config.vocab_size
    for e in engines.values():
        e.generate(prompts_of(2, 32, vocab, 7), SamplingParams(max_tokens=4, temperature=0))  # warm-up
    rows = []
    for input_len in input_lens:
        for b in batches:
            row = {"input_len": input_len, "batch": b}
            prefills = [e for e in engines if e != "graph"]   # graphs run decode steps only
            runs: dict[str, list[dict]] = {name: [] for name in engines}
            for _ in range(args.repeat):
                for name in prefills:
                    row[f"{name}_prefill_tok_s"] = max(row.get(f"{name}_prefill_tok_s", 0.0),
                                                      bench_tandem_prefill(engines[name], b, input_len))
                for name, e in engines.items():
                    runs[name].append(bench_tandem_decode(e, b, input_len, args.output_len))
            for name, results in runs.items():
                best = max(results, key=lambda r: r["decode_tok_s"])
                row.update({f"{name}_{k}": v for k, v in best.items()})
            if "graph" in engines:
                row["graph_speedup"] = row["graph_decode_tok_s"] / row["tandem_decode_tok_s"]
            if "prepack" in engines:
                row["prepack_speedup"] = row["prepack_decode_tok_s"] / row["tandem_decode_tok_s"]
                row["prepack_prefill_speedup"] = row["prepack_prefill_tok_s"] / row["tandem_prefill_tok_s"]
            if "extend_kernel" in engines:
                row["extend_default_prefill_speedup"] = row["tandem_prefill_tok_s"] / row["extend_kernel_prefill_tok_s"]
            if "page_first" in engines:
                row["page_first_speedup"] = row["page_first_decode_tok_s"] / row["tandem_decode_tok_s"]
                row["page_first_prefill_speedup"] = row["page_first_prefill_tok_s"] / row["tandem_prefill_tok_s"]
            rows.append(row)
            print(json.dumps(row))
    mixed = {}
    if args.mixed_requests:
        prompts, outs = mixed_workload(args.mixed_requests, vocab)
        mixed["tandem"] = bench_tandem_mixed(engine, prompts, outs)
        print("mixed", json.dumps(mixed))
    for e in engines.values():
        e.check_idle()

    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=engine.runner.dtype).eval()
        bench_hf(hf, 1, 16, 4, vocab)  # warm-up
        for row in rows:
            hf_row = bench_hf(hf, row["batch"], row["input_len"], args.output_len, vocab)
            row["hf_prefill_tok_s"] = hf_row["prefill_tok_s"]
            row["hf_decode_tok_s"] = hf_row["decode_tok_s"]
            row["decode_speedup_vs_hf"] = row["tandem_decode_tok_s"] / hf_row["decode_tok_s"]
            print(json.dumps(row))
        if args.mixed_requests:
            mixed["hf_static_batch"] = bench_hf_mixed(hf, prompts, outs, max_batch)
            mixed["speedup_vs_hf"] = mixed["tandem"]["output_tok_s"] / mixed["hf_static_batch"]["output_tok_s"]
            print("mixed", json.dumps(mixed))

    result = {
        "bench": "engine",
        "model": args.model,
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "engine_choices": engine.runner.describe_choices(),
        "input_lens": input_lens,
        "output_len": args.output_len,
        "threads": torch.get_num_threads(),
        "startup": startup,
        "machine": {"cpu": engine.runner.hardware.summary(), "torch": torch.__version__},
        "rows": rows,
        "mixed_workload": {"requests": args.mixed_requests, "prompt_len": [32, 256], "output_len": [16, 128],
                           "batch": max_batch, **mixed},
    }
    write_result(args.out, result, tool="tandem.bench.engine")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
