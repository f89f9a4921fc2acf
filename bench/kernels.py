"""Paged decode attention on a GPU: achieved GB/s and % of peak HBM bandwidth, Triton kernel vs the
torch backend (page gather + SDPA), per layer.

    python -m tandem.bench.kernels --out bench/results/kernels.json
    python -m tandem.bench.kernels --cases 64x4096 1x32768 --heads 32 --kv-heads 8 --head-dim 128

Bytes counted are what attention must read and write at least once: every cached K and V row of
every sequence, the queries, the outputs and the page table. The pool's pages are handed out in a
random order (a fragmented pool), and each timing flushes L2 first (`triton.testing.do_bench`).
Peak bandwidth comes from `--peak-gbps`, else from a table of known GPUs; a device-to-device copy
is measured beside it as the practical ceiling.

Without CUDA there is nothing to measure: the script says so and runs a tiny interpreter smoke
(Triton vs torch on a few tokens, correctness only) so that it is exercised on CPU too.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

from tandem.bench.flags import add_out_flag
from tandem.bench.results import write_result

# HBM bandwidth in GB/s (vendor figures), matched against torch.cuda.get_device_name().
PEAK_GBPS = [
    ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350),
    ("GH200", 4000), ("B200", 8000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935),
    ("A100", 1555), ("L40S", 864), ("L4", 300), ("A10G", 600), ("RTX 4090", 1008), ("RTX 3090", 936),
]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def peak_gbps(name: str) -> float | None:
    for key, gbps in PEAK_GBPS:
        if key in name:
            return float(gbps)
    return None


def make_case(batch: int, context: int, args, device: torch.device, seed: int = 0):
    """One layer's pool holding `batch` sequences of `context` tokens on randomly ordered pages."""
    from tandem.engine.kvcache.kv_pool import KVPool, KVPoolSpec

    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_each = -(-context // args.page_size)
    spec = KVPoolSpec(1, batch * pages_each + 1, args.page_size, args.kv_heads, args.head_dim, dtype)
    pool = KVPool(spec, device)
    pool.buffer.normal_(generator=gen)
    order = torch.randperm(spec.num_pages - 1, generator=gen, device=device) + 1
    page_table = order[: batch * pages_each].view(batch, pages_each).to(torch.int32)
    q = torch.randn(batch, args.heads, args.head_dim, generator=gen, device=device).to(dtype)
    return pool, page_table, q


def decode_context(pool, page_table, batch: int, context: int, backend):
    """A decode-step ForwardContext whose new token is the last of each sequence's `context`."""
    from tandem.engine.forward_context import ForwardContext

    device = page_table.device
    ps = pool.spec.page_size
    pos = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    rows = torch.arange(batch, device=device)
    slots = page_table[rows, pos // ps].to(torch.int64) * ps + pos % ps
    ctx = ForwardContext(
        input_ids=torch.zeros(batch, dtype=torch.int64, device=device), positions=pos, out_slots=slots,
        logits_indices=rows, page_table=page_table, q_lens=[1] * batch, prefix_lens=[context - 1] * batch,
        kv_lens=[context] * batch, is_decode=True, attn=backend,
    )
    backend.prepare(ctx)
    return ctx


def extend_context(pool, page_table, tokens: int, prefix: int, backend):
    """A ForwardContext for sequence 0's `tokens` new tokens after `prefix` cached ones."""
    from tandem.engine.forward_context import ForwardContext

    device = page_table.device
    ps = pool.spec.page_size
    pos = torch.arange(prefix, prefix + tokens, device=device)
    slots = page_table[0, pos // ps].to(torch.int64) * ps + pos % ps
    ctx = ForwardContext(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device), positions=pos, out_slots=slots,
        logits_indices=torch.tensor([tokens - 1], device=device), page_table=page_table[:1], q_lens=[tokens],
        prefix_lens=[prefix], kv_lens=[prefix + tokens], is_decode=False, attn=backend,
    )
    backend.prepare(ctx)
    return ctx


def bench_case(batch: int, context: int, args, device: torch.device, peak: float | None) -> dict:
    import triton.testing

    from tandem.engine.attention.base import create_backend
    from tandem.kernels.decode_attention import default_num_splits, paged_decode_attention

    pool, page_table, q = make_case(batch, context, args, device)
    kv_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    scale = args.head_dim ** -0.5
    splits = args.num_splits or default_num_splits(batch, args.kv_heads, context, device)

    def triton_fn():
        return paged_decode_attention(q, pool.k(0), pool.v(0), page_table, kv_lens, scale,
                                      max_kv_len=context, num_splits=splits, block_n=args.block_n)

    torch_backend = create_backend("torch", pool, args.heads, args.head_dim)
    ctx = decode_context(pool, page_table, batch, context, torch_backend)
    new_k = pool.k(0)[pool.slot_index(ctx.out_slots)].clone()   # rewriting the same values keeps the pool as is
    new_v = pool.v(0)[pool.slot_index(ctx.out_slots)].clone()

    def torch_fn():
        return torch_backend.forward(0, q, new_k, new_v, ctx)

    diff = (triton_fn().float() - torch_fn().float()).abs().max().item()
    elem = pool.buffer.element_size()
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * elem
    io_bytes = 2 * q.numel() * elem + page_table.numel() * 4
    total = kv_bytes + io_bytes
    row = {"batch": batch, "context": context, "num_splits": splits, "kv_bytes": kv_bytes,
           "max_abs_diff": diff}
    for name, fn in (("triton", triton_fn), ("torch", torch_fn)):
        ms = triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median")
        gbps = total / (ms * 1e-3) / 1e9
        row[f"{name}_us"] = round(ms * 1e3, 1)
        row[f"{name}_gbps"] = round(gbps, 1)
        row[f"{name}_pct_peak"] = round(100 * gbps / peak, 1) if peak else None
    row["speedup"] = round(row["torch_us"] / row["triton_us"], 2)
    return row


def copy_gbps(device: torch.device) -> float:
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return round(2 * src.numel() / (ms * 1e-3) / 1e9, 1)


def smoke() -> int:
    """CPU: the same comparison on a few tokens under the Triton interpreter (correctness only)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernel modules are imported
    from tandem.engine.attention.base import create_backend
    from tandem.kernels.decode_attention import paged_decode_attention

    args = argparse.Namespace(dtype="float32", page_size=4, heads=4, kv_heads=2, head_dim=16)
    device = torch.device("cpu")
    pool, page_table, q = make_case(2, 11, args, device)
    ctx = decode_context(pool, page_table, 2, 11, create_backend("torch", pool, 4, 16))
    k, v = pool.k(0)[pool.slot_index(ctx.out_slots)].clone(), pool.v(0)[pool.slot_index(ctx.out_slots)].clone()
    expected = ctx.attn.forward(0, q, k, v, ctx)
    kv_lens = torch.tensor([11, 11], dtype=torch.int32)
    out = paged_decode_attention(q, pool.k(0), pool.v(0), page_table, kv_lens, 16 ** -0.5,
                                 num_splits=2, block_n=16)
    diff = (out - expected).abs().max().item()
    verdict = "ok" if diff < 1e-5 else "MISMATCH"
    print(f"interpreter smoke: triton vs torch max |diff| = {diff:.2e} ({verdict})")
    return 0 if diff < 1e-5 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["64x4096", "16x4096", "64x1024", "1x32768", "8x16384"],
                   help="BATCHxCONTEXT pairs")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--num-splits", type=int, default=None, help="default: kernels' heuristic")
    p.add_argument("--block-n", type=int, default=None, help="keys per tile; default: kernels' choice")
    p.add_argument("--peak-gbps", type=float, default=None, help="HBM peak; default from the GPU's name")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=200)
    add_out_flag(p, type=Path)
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench.kernels: no CUDA device here; GB/s and % of peak need a GPU. "
              "Running a tiny Triton-interpreter smoke instead (timings meaningless on CPU).")
        return smoke()

    import triton

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_gbps or peak_gbps(name)
    result = {
        "device": name, "peak_gbps": peak, "copy_gbps": copy_gbps(device),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "shape": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "page_size": args.page_size, "dtype": args.dtype, "block_n": args.block_n},
        "cases": [],
    }
    print(f"{name}: peak {peak} GB/s, device copy {result['copy_gbps']} GB/s")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'triton us':>10} {'GB/s':>7} {'%peak':>6} "
          f"{'torch us':>10} {'GB/s':>7} {'%peak':>6} {'speedup':>7}")
    for case in args.cases:
        batch, context = (int(x) for x in case.lower().split("x"))
        row = bench_case(batch, context, args, device, peak)
        result["cases"].append(row)
        print(f"{batch:>5} {context:>7} {row['num_splits']:>6} {row['triton_us']:>10} "
              f"{row['triton_gbps']:>7} {row['triton_pct_peak']!s:>6} {row['torch_us']:>10} "
              f"{row['torch_gbps']:>7} {row['torch_pct_peak']!s:>6} {row['speedup']:>7}")
        torch.cuda.empty_cache()
    if args.out:
        write_result(args.out, result, tool="tandem.bench.kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
