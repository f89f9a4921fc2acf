"""Which dtype serves fastest on this CPU: the measurement behind `--dtype auto` (engine/hardware.py).

    python -m tandem.bench.dtype_choice --out bench/results/dtype_choice.json
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python -m tandem.bench.dtype_choice --out bench/results/dtype_choice_avx2.json   # an AVX2-only CPU, emulated

Two parts, one thread each:
- **Projections**: every linear layer of the model (its real shapes, its 30 layers, weights streamed
  from memory as in a step) at 1, 8 and 32 rows (decode batches) and 256 rows (a prefill chunk), in
  four forms: fp32; bf16 (what a bf16 model runs); bf16 weights converted to fp32 per call (bf16
  storage, fp32 compute); weight-only int8 (`torch._weight_int8pack_mm`, fp32 activations).
- **Engine**: the whole engine in fp32 and in bf16: prefill tokens/s of 256-token prompts and decode
  tokens/s at batch 8 over 256-token contexts (bench/engine.py's measurements).

The JSON names the CPU (and any ISA cap in force), what `auto` chose, and which form was fastest
per shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from tandem.bench.engine import bench_tandem_decode, bench_tandem_prefill, prompts_of
from tandem.bench.flags import add_out_flag, add_stack_flags
from tandem.bench.results import write_result
from tandem.engine.config import EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.hardware import choose_dtype, detect
from tandem.engine.models.config import ModelConfig
from tandem.engine.models.source import resolve_model
from tandem.engine.sampling_params import SamplingParams

ROWS = (1, 8, 32, 256)


def projection_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one decoder layer's projections: fused QKV, O, fused gate/up, down."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return [(qkv, cfg.hidden_size), (cfg.hidden_size, cfg.num_heads * cfg.head_dim),
            (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]


def _time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):     # the fastest run: on shared cores the least disturbed one
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_projections(cfg: ModelConfig, repeat: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) * 0.02 for o, i in projection_shapes(cfg) for _ in range(cfg.num_layers)]
    bf16 = [w.bfloat16() for w in weights]
    int8, scales = [], []
    for w in weights:
        s = w.abs().amax(1) / 127
        int8.append((w / s[:, None]).round().clamp(-127, 127).to(torch.int8))
        scales.append(s)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    rows_out = []
    for m in ROWS:
        xs = {i: torch.randn(m, i, generator=g) for _, i in projection_shapes(cfg)}
        xb = {i: x.bfloat16() for i, x in xs.items()}
        forms = {
            "fp32": lambda xs=xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
            "bf16": lambda xb=xb: [torch.nn.functional.linear(xb[w.shape[1]], w) for w in bf16],
            "bf16_weights_fp32_compute": lambda xs=xs: [torch.nn.functional.linear(xs[w.shape[1]], w.float())
                                                        for w in bf16],
            "int8_weight_only": lambda xs=xs: [torch._weight_int8pack_mm(xs[w.shape[1]], w, s)
                                               for w, s in zip(int8, scales, strict=True)],
        }
        ms = {name: _time(fn, repeat) * 1e3 for name, fn in forms.items()}
        row = {"rows": m, "ms": ms, "gflop_s": {k: flops_per_row * m / v / 1e6 for k, v in ms.items()},
               "fastest": min(ms, key=ms.get)}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return rows_out


def bench_engine(model: str, dtype: str) -> dict:
    engine = LLMEngine(dataclasses.replace(EngineConfig(), model=model, dtype=dtype, enable_prefix_cache=False,
                                           kv_cache_gb=1.0, enable_mixed_chunk=False, chunked_prefill_size=4096,
                                           max_running_requests=8, num_threads=1))
    vocab = engine.model_config.vocab_size
    engine.generate(prompts_of(2, 32, vocab, 7), SamplingParams(max_tokens=4, temperature=0))   # warm-up
    out = {"prefill_tok_s": max(bench_tandem_prefill(engine, 2, 256) for _ in range(2)),
           "decode_tok_s_batch8": bench_tandem_decode(engine, 8, 256, 32)["decode_tok_s"],
           "engine_choices": engine.runner.describe_choices()}
    engine.check_idle()
    print(dtype, json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_stack_flags(ap, model="smollm2-135m")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-engine", action="store_true")
    add_out_flag(ap, "bench/results/dtype_choice.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = resolve_model(args.model)
    cfg = ModelConfig.from_pretrained(path)
    hw = detect("cpu")
    auto = choose_dtype(hw, cfg.torch_dtype)
    print(f"{hw.summary()}: auto -> {auto.value} ({auto.reason})", flush=True)
    result = {"bench": "dtype_choice", "model": args.model, "hardware": hw.summary(), "isa": hw.isa,
              "native_bf16": hw.native_bf16, "auto_dtype": str(auto.value).removeprefix("torch."),
              "auto_reason": auto.reason, "threads": 1, "projections": bench_projections(cfg, args.repeat)}
    if not args.skip_engine:
        result["engine"] = {d: bench_engine(args.model, d) for d in ("float32", "bfloat16")}
        fast = max(result["engine"], key=lambda d: result["engine"][d]["prefill_tok_s"])
        result["engine_fastest_prefill"] = fast
        result["auto_is_fastest_prefill"] = fast == result["auto_dtype"]
    write_result(args.out, result, tool="tandem.bench.dtype_choice")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
