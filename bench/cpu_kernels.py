"""The fused CPU kernels (kernels/cpu) against the torch code they replace, on one core.

    python -m tandem.bench.cpu_kernels --out bench/results/cpu_kernels.json
    python -m tandem.bench.cpu_kernels --parts extend --out bench/results/cpu_extend.json
    python -m tandem.bench.cpu_kernels --parts linear --out bench/results/cpu_linear.json

Four parts (`--parts`):
- **ops**: one layer's decode attention through the torch backend as a step runs it, with and
  without the kernel (rows x keys of SmolLM2's 9 query / 3 KV heads, head dim 64, pages in random
  order: `bench.kernels.make_case`), and RMSNorm + residual and RoPE at 1 / 12 / 256 tokens;
  median of 50 calls each.
- **extend**: prefill/extend attention through the torch backend, `paged_extend_attention` against
  the SDPA path it replaces (fp32 causal SDPA without a prefix; with one, the gathered pages and an
  explicit mask), in fp32 and bf16 (bf16 also as SDPA in bf16, `sdpa_native_ms`: what a CPU with AMX
  runs), 256-2,048 tokens with and without a cached prefix; for the
  variant this CPU loads and again, in a child process, for the avx2 variant under the AVX2
  emulation (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`: torch's
  SDPA, oneDNN and MKL run their AVX2 code too).
- **linear**: fp32 `y = x Wᵀ` at SmolLM2's projection shapes (fused QKV 960x576, O 576x576, gate/up
  3072x576, down 576x1536, the vocab 49152x576) and 1-256 rows: MKL (`F.linear`), oneDNN on a
  prepacked weight (`_linear_pointwise`), Tandem's kernel (`linear`, panel-packed fp32 weights, the
  engine's fp32 default) and the same kernel on bf16-stored weights; GFLOP/s, best of 5 calls, each
  call over enough copies of the weight (~160 MB) that it streams from memory as in a real step. For
  the variant this CPU loads and, in a child under the AVX2 emulation, the avx2 one.
- **steps**: whole decode steps of the real model (`LLMEngine.step()`, 300-token prompts) at several
  batch sizes on two engines, one with the kernels and one without, measured alternately; the median
  of each engine's steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tandem.bench.engine import prompts_of
from tandem.bench.flags import add_out_flag, add_stack_flags
from tandem.bench.kernels import decode_context, extend_context, make_case
from tandem.bench.results import write_result
from tandem.engine.attention.base import create_backend
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.models.layers import RMSNorm
from tandem.engine.models.rope import _rotate
from tandem.engine.sampling_params import SamplingParams
from tandem.kernels.cpu import load, runnable_levels

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16


def call_times(fn, n: int, warmup: int) -> list[float]:
    """Seconds of each of `n` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_ms(fn, n: int = 50) -> float:
    return statistics.median(call_times(fn, n, warmup=5)) * 1e3


CASE = SimpleNamespace(dtype="bfloat16", page_size=PAGE, heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM)


def time_backends(ops, pool, q, make_ctx, n: int = 50, native_sdpa: bool = False) -> dict:
    """One layer's attention through the torch backend as a step runs it (KV write included), without
    and with the kernels, and with `native_sdpa` also SDPA in the pool's dtype (the backend's
    `extend_attention = "sdpa"`, bf16 on AMX); `make_ctx(backend)` builds the step's ForwardContext."""
    variants = [("torch", None, "kernel"), ("kernel", ops, "kernel")] + ([("sdpa_native", ops, "sdpa")] if native_sdpa else [])
    times = {}
    for name, cpu_ops, extend in variants:
        backend = create_backend("torch", pool, HEADS, DIM)
        backend.cpu_ops, backend.extend_attention = cpu_ops, extend
        ctx = make_ctx(backend)
        new_k, new_v = pool.k(0)[pool.slot_index(ctx.out_slots)].clone(), pool.v(0)[pool.slot_index(ctx.out_slots)].clone()
        times[name] = median_ms(partial(backend.forward, 0, q, new_k, new_v, ctx), n)
    out = {"torch_ms": times["torch"], "kernel_ms": times["kernel"], "speedup": times["torch"] / times["kernel"]}
    if native_sdpa:
        out.update(sdpa_native_ms=times["sdpa_native"], sdpa_native_vs_kernel=times["kernel"] / times["sdpa_native"])
    return out


def bench_attention(ops, rows: int, keys: int) -> dict:
    """Decode attention for `rows` rows of `keys` keys; pages in random order (bench.kernels)."""
    pool, page_table, q = make_case(rows, keys, CASE, torch.device("cpu"), seed=rows * keys)
    times = time_backends(ops, pool, q, lambda backend: decode_context(pool, page_table, rows, keys, backend))
    return {"op": "decode_attention", "rows": rows, "keys": keys, **times}


# (new tokens, cached prefix): prefills, a prefix-cache hit on half the prompt, a last 256-token chunk.
EXTEND_CASES = [(256, 0), (1024, 0), (2048, 0), (128, 128), (512, 512), (1024, 1024), (256, 768), (256, 1792)]
EMULATE_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def bench_extend(ops, tokens: int, prefix: int, dtype: str) -> dict:
    """Prefill/extend attention of `tokens` new tokens over `prefix` cached ones: the SDPA path in fp32
    against `paged_extend_attention`, and for bf16 SDPA in bf16 (what AMX CPUs run)."""
    case = SimpleNamespace(**{**vars(CASE), "dtype": dtype})
    pool, page_table, _ = make_case(1, prefix + tokens, case, torch.device("cpu"), seed=tokens + prefix)
    q = torch.randn(tokens, HEADS, DIM, generator=torch.Generator().manual_seed(tokens)).to(pool.spec.dtype)
    times = time_backends(ops, pool, q, lambda backend: extend_context(pool, page_table, tokens, prefix, backend),
                          n=5 if prefix + tokens > 1024 else 20, native_sdpa=dtype == "bfloat16")
    return {"op": "extend_attention", "level": ops.LEVEL, "torch_cpu": torch.backends.cpu.get_cpu_capability(),
            "dtype": dtype, "tokens": tokens, "prefix": prefix,
            "sdpa": "gathered+masked" if prefix else "causal", **times}


def extend_rows(ops) -> list[dict]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        if ops.extend_attention_supported(getattr(torch, dtype), DIM):
            for n, p in EXTEND_CASES:
                rows.append(bench_extend(ops, n, p, dtype))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def emulated_avx2_rows(part: str) -> list[dict]:
    """The rows of `part` for the avx2 variant, in a child process under the AVX2 emulation (the caps
    must be in the environment before torch starts)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{part}.json"
        subprocess.run([sys.executable, "-P", "-m", "tandem.bench.cpu_kernels", "--parts", part, "--no-emulation",
                        "--out", str(out)], env={**os.environ, **EMULATE_AVX2}, check=True)
        return json.loads(out.read_text())[part]


LINEAR_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                 "vocab": (49152, 576)}
LINEAR_ROWS = (1, 4, 8, 16, 32, 64, 256)
STREAM_BYTES = 160e6   # weights per timed call: past the L3, so they stream from memory as in a step


def best_s(fn, n: int = 5) -> float:
    return min(call_times(fn, n, warmup=1))


def linear_rows(ops) -> list[dict]:
    rows = []
    for name, (n, k) in LINEAR_SHAPES.items():
        g = torch.Generator().manual_seed(n + k)
        weights = [torch.randn(n, k, generator=g) for _ in range(max(1, int(STREAM_BYTES // (n * k * 4))))]
        impls = {
            "mkl": (weights, F.linear),
            "onednn": ([torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights],
                       lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
            "kernel": ([ops.pack_linear(w) for w in weights], lambda x, w, n=n: ops.linear(x, w, None, n)),
            "kernel_bf16_weights": ([ops.pack_linear(w, torch.bfloat16) for w in weights],
                                    lambda x, w, n=n: ops.linear(x, w, None, n)),
        }
        for m in LINEAR_ROWS:
            x = torch.randn(m, k, generator=g)
            row = {"op": "linear", "level": ops.LEVEL, "torch_cpu": torch.backends.cpu.get_cpu_capability(),
                   "shape": name, "n": n, "k": k, "rows": m}
            for impl, (ws, fn) in impls.items():
                seconds = best_s(lambda ws=ws, fn=fn, x=x: [fn(x, w) for w in ws]) / len(ws)
                row[f"{impl}_gflops"] = 2 * m * n * k / seconds / 1e9
            row["speedup_vs_best_library"] = row["kernel_gflops"] / max(row["mkl_gflops"], row["onednn_gflops"])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del impls, weights
    return rows


def bench_norm_rope(ops, tokens: int) -> list[dict]:
    g = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(576, 1e-5).bfloat16()
    x = torch.randn(tokens, 576, generator=g).bfloat16()
    residual = torch.randn(tokens, 576, generator=g)
    qkv = torch.randn(tokens, 960, generator=g).bfloat16()
    q, kk, _ = qkv.split([576, 192, 192], dim=-1)
    q, kk = q.view(tokens, HEADS, DIM), kk.view(tokens, KV_HEADS, DIM)
    cos, sin = torch.randn(tokens, 1, DIM // 2, generator=g), torch.randn(tokens, 1, DIM // 2, generator=g)
    norm_t = median_ms(lambda: norm.add_forward(x, residual))
    norm_k = median_ms(lambda: ops.rms_norm(x, residual, norm.weight, 1e-5))
    rope_t = median_ms(lambda: (_rotate(q, cos, sin), _rotate(kk, cos, sin)))
    rope_k = median_ms(lambda: ops.rope_(q, kk, cos.squeeze(1), sin.squeeze(1)))
    return [{"op": "add_rms_norm", "tokens": tokens, "torch_ms": norm_t, "kernel_ms": norm_k, "speedup": norm_t / norm_k},
            {"op": "rope", "tokens": tokens, "torch_ms": rope_t, "kernel_ms": rope_k, "speedup": rope_t / rope_k}]


def decode_steps(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> list[float]:
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    for p in prompts_of(batch, prompt_len, engine.model_config.vocab_size, seed=batch):
        engine.add_request(p, params)
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    add_stack_flags(ap, model="smollm2-135m")
    ap.add_argument("--parts", default="ops,extend,linear,steps", help="any of ops, extend, linear, steps")
    ap.add_argument("--no-emulation", action="store_true",
                    help="skip the avx2 variant's extend and linear rows under the AVX2 emulation")
    ap.add_argument("--batches", default="1,12,24")
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40, help="decode steps per batch and engine")
    ap.add_argument("--repeat", type=int, default=2, help="alternate the two engines this many times per batch")
    add_out_flag(ap, "bench/results/cpu_kernels.json")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    torch.set_num_threads(1)
    ops = load()
    if ops is None:
        raise SystemExit("the CPU kernels could not be built here (python -m tandem.kernels.cpu -v)")
    out = {"machine": platform.processor() or platform.machine(), "threads": 1, "level": ops.LEVEL}
    if "ops" in parts:
        rows = [bench_attention(ops, r, n) for r, n in [(1, 300), (12, 300), (24, 300), (24, 600), (32, 600)]]
        for tokens in (1, 12, 256):
            rows += bench_norm_rope(ops, tokens)
        for r in rows:
            print(json.dumps(r))
        out["ops"] = rows
    if "extend" in parts:
        out["extend"] = extend_rows(ops)
        if not args.no_emulation and ops.LEVEL not in ("generic", "avx2") and "avx2" in runnable_levels():
            out["extend"] += emulated_avx2_rows("extend")
    if "linear" in parts:
        out["linear"] = linear_rows(ops)
        if not args.no_emulation and ops.LEVEL not in ("generic", "avx2") and "avx2" in runnable_levels():
            out["linear"] += emulated_avx2_rows("linear")
    if "steps" in parts:
        out["steps"] = bench_steps(args)
    write_result(args.out, out, tool="tandem.bench.cpu_kernels")


def bench_steps(args) -> list[dict]:
    base = EngineConfig(model=args.model, dtype="bfloat16", enable_prefix_cache=False, kv_cache_gb=1.0,
                        chunked_prefill_size=8192, enable_mixed_chunk=False, num_threads=1,
                        max_running_requests=max(int(b) for b in args.batches.split(",")))
    engines = {"torch": LLMEngine(dataclasses.replace(base, enable_cpu_kernels=False)),
               "kernels": LLMEngine(dataclasses.replace(base, enable_cpu_kernels=True))}
    steps = []
    for batch in (int(b) for b in args.batches.split(",")):
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeat):
            for name, engine in engines.items():
                times[name] += decode_steps(engine, batch, args.prompt_len, args.steps)
        row = {"batch": batch, "prompt_len": args.prompt_len,
               **{f"{name}_step_ms": statistics.median(t) * 1e3 for name, t in times.items()}}
        row["speedup"] = row["torch_step_ms"] / row["kernels_step_ms"]
        steps.append(row)
        print(json.dumps(row))
    return steps


if __name__ == "__main__":
    main()
