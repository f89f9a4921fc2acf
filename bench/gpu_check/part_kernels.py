"""Part `kernels`: each Triton kernel against its torch reference on the GPU — the same answer, and
the bandwidth each achieves as a share of the device's peak.

Paged decode attention is bench/kernels.py's measurement (a fragmented pool, L2 flushed before every
timing, Llama-3-8B-like heads), against the torch backend. RMSNorm, RoPE, KV store and KV page
packing (from both pool layouts) are memory-bound too: their bytes are what they must read and
write once, against kernels/reference.py. The LoRA shrink/expand kernels (a decode and a prefill
step of mixed adapters) are timed through the engine's LoRA batch against its torch paths. Peaks: the datasheet figure (bench.kernels.PEAK_GBPS), the one computed from
the device's memory clock and bus width, and a device-to-device copy measured here (the practical
ceiling). A kernel that disagrees with its reference fails the part; a slow one does not.
"""

from __future__ import annotations

import argparse

import torch

from tandem.bench.gpu_check.report import main_of, require

DECODE_CASES = ("64x4096", "16x4096", "64x1024", "1x32768", "8x16384")
DECODE_SHAPE = dict(heads=32, kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
BF16_ATOL = 2e-2     # tests/kernels/helpers.TOL for bf16: one rounding of the output


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rate(name: str, nbytes: int, triton_ms: float, torch_ms: float, peaks: dict, **extra) -> dict:
    row = {"kernel": name, **extra, "bytes": nbytes,
           "triton_us": round(triton_ms * 1e3, 1), "torch_us": round(torch_ms * 1e3, 1),
           "triton_gbps": round(nbytes / triton_ms / 1e6, 1), "torch_gbps": round(nbytes / torch_ms / 1e6, 1),
           "speedup": round(torch_ms / triton_ms, 2)}
    for key, peak in peaks.items():
        row[f"triton_pct_{key}"] = round(100 * row["triton_gbps"] / peak, 1) if peak else None
    return row


def decode_attention(peaks: dict, peak: float | None) -> list[dict]:
    from tandem.bench.kernels import bench_case

    dev = torch.device("cuda")
    args = argparse.Namespace(**DECODE_SHAPE, num_splits=None, block_n=None, warmup_ms=25, rep_ms=100)
    rows = []
    for case in DECODE_CASES:
        batch, context = (int(x) for x in case.split("x"))
        row = bench_case(batch, context, args, dev, peak)
        require(row["max_abs_diff"] <= BF16_ATOL,
                f"decode attention {case}: triton and torch differ by {row['max_abs_diff']:.3g} (> {BF16_ATOL})")
        total = row["kv_bytes"] + 2 * batch * args.heads * args.head_dim * 2
        rows.append(rate("decode_attention", total, row["triton_us"] / 1e3, row["torch_us"] / 1e3, peaks,
                         shape=case, num_splits=row["num_splits"], max_abs_diff=row["max_abs_diff"]))
        torch.cuda.empty_cache()
    return rows


def rms_norm(peaks: dict, tokens: int = 16384, hidden: int = 4096) -> dict:
    from tandem.kernels import reference
    from tandem.kernels.rmsnorm import rms_norm as kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    res = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    (y, r), (y_ref, r_ref) = kernel(x, w, 1e-6, residual=res), reference.rms_norm(x, w, 1e-6, residual=res)
    diff = max((y.float() - y_ref.float()).abs().max().item(), (r.float() - r_ref.float()).abs().max().item())
    require(all(torch.allclose(a.float(), b.float(), atol=BF16_ATOL, rtol=BF16_ATOL) for a, b in ((y, y_ref), (r, r_ref))),
            f"rms_norm differs from the reference by {diff:.3g}")
    nbytes = 4 * x.numel() * 2 + hidden * 2                  # read x, residual; write y, new residual
    return rate("rms_norm", nbytes, bench_ms(lambda: kernel(x, w, 1e-6, residual=res)),
                bench_ms(lambda: reference.rms_norm(x, w, 1e-6, residual=res)), peaks,
                shape=f"{tokens}x{hidden} bf16 +residual", max_abs_diff=diff)


def rope(peaks: dict, tokens: int = 16384, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict:
    from tandem.kernels import reference
    from tandem.kernels.rope import apply_rope

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(tokens, heads, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(tokens, kv_heads, dim, device="cuda", generator=g).bfloat16()
    angle = torch.rand(tokens, dim // 2, device="cuda", generator=g) * 6.28
    cos, sin = angle.cos(), angle.sin()
    (qo, ko), (qr, kr) = apply_rope(q, k, cos, sin), reference.rope(q, k, cos, sin)
    diff = max((qo.float() - qr.float()).abs().max().item(), (ko.float() - kr.float()).abs().max().item())
    require(all(torch.allclose(a.float(), b.float(), atol=BF16_ATOL, rtol=BF16_ATOL) for a, b in ((qo, qr), (ko, kr))),
            f"rope differs from the reference by {diff:.3g}")
    nbytes = 2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 4
    return rate("rope", nbytes, bench_ms(lambda: apply_rope(q, k, cos, sin)),
                bench_ms(lambda: reference.rope(q, k, cos, sin)), peaks,
                shape=f"{tokens} tokens {heads}/{kv_heads} heads x {dim} bf16", max_abs_diff=diff)


def kv_store(peaks: dict, tokens: int = 16384, pages: int = 4096, page_size: int = 16,
             kv_heads: int = 8, dim: int = 128) -> dict:
    from tandem.kernels import reference
    from tandem.kernels.kv_store import store_kv

    g = torch.Generator(device="cuda").manual_seed(2)
    k = torch.randn(tokens, kv_heads, dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(tokens, kv_heads, dim, device="cuda", generator=g).bfloat16()
    slots = torch.randperm(pages * page_size, device="cuda", generator=g)[:tokens]
    kc, vc = (torch.zeros(pages, page_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kr, vr = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    reference.store_kv(k, v, kr, vr, slots)
    require(torch.equal(kc, kr) and torch.equal(vc, vr), "store_kv wrote other bytes than the reference")
    nbytes = 2 * 2 * k.numel() * 2 + slots.numel() * 8
    return rate("store_kv", nbytes, bench_ms(lambda: store_kv(k, v, kc, vc, slots)),
                bench_ms(lambda: reference.store_kv(k, v, kr, vr, slots)), peaks,
                shape=f"{tokens} tokens into {pages}x{page_size} slots, {kv_heads}x{dim} bf16")


def kv_pack(peaks: dict, layers: int = 8, pages: int = 2048, picked: int = 1024, page_size: int = 16,
            kv_heads: int = 8, dim: int = 128) -> list[dict]:
    """Both pool layouts (`--kv-layout`): page-first, the GPU default, reads each page of every layer as
    one block; layer-first reads 2 x layers strided pieces of it."""
    g = torch.Generator(device="cuda").manual_seed(3)
    by_layer = torch.randn(layers, 2, pages, page_size, kv_heads, dim, device="cuda", generator=g).bfloat16()
    ids = torch.randperm(pages, device="cuda", generator=g)[:picked]
    shape = f"{picked} of {pages} pages, {layers} layers, {page_size}x{kv_heads}x{dim} bf16"
    rows = kv_pack_layout(peaks, by_layer, ids, "page_first", shape)
    torch.cuda.empty_cache()
    return rows + kv_pack_layout(peaks, by_layer, ids, "layer_first", shape)


def kv_pack_layout(peaks: dict, by_layer: torch.Tensor, ids: torch.Tensor, kv_layout: str, shape: str) -> list[dict]:
    from tandem.kernels import reference
    from tandem.kernels.kv_pack import pack_kv_pages, unpack_kv_pages

    buf = by_layer.movedim(2, 0).contiguous() if kv_layout == "page_first" else by_layer
    staged = pack_kv_pages(buf, ids, kv_layout=kv_layout)
    require(torch.equal(staged, reference.pack_kv_pages(by_layer, ids)),
            f"pack_kv_pages ({kv_layout}) differs from the reference")
    back = torch.zeros_like(buf)
    unpack_kv_pages(staged, back, ids, kv_layout=kv_layout)
    ref = torch.zeros_like(buf)
    reference.unpack_kv_pages(staged, ref, ids, kv_layout=kv_layout)
    require(torch.equal(back, ref), f"unpack_kv_pages ({kv_layout}) differs from the reference")
    nbytes = 2 * staged.numel() * 2
    shape = f"{shape}, {kv_layout}"
    return [rate("pack_kv_pages", nbytes, bench_ms(lambda: pack_kv_pages(buf, ids, kv_layout=kv_layout, out=staged)),
                 bench_ms(lambda: reference.pack_kv_pages(buf, ids, kv_layout=kv_layout)), peaks, shape=shape),
            rate("unpack_kv_pages", nbytes, bench_ms(lambda: unpack_kv_pages(staged, back, ids, kv_layout=kv_layout)),
                 bench_ms(lambda: reference.unpack_kv_pages(staged, ref, ids, kv_layout=kv_layout)), peaks,
                 shape=shape)]


LORA_CASES = ((64, 8, 1), (8192, 4, 512))   # (tokens, adapters, tokens per sequence): a decode and a prefill step


def lora(peaks: dict) -> list[dict]:
    rows = []
    for tokens, count, per_seq in LORA_CASES:
        rows.append(lora_case(peaks, tokens, count, per_seq))
        torch.cuda.empty_cache()
    return rows


def lora_case(peaks: dict, tokens: int, count: int, per_seq: int, hidden: int = 4096, out: int = 6144,
              rank: int = 48) -> dict:
    """One fused projection (q/k/v of a Llama-3-8B-like model, rank 16 on each part: 48) for a step of
    `tokens` whose sequences use `count` adapters, interleaved, through the engine's LoRA batch
    (engine/lora/batch.py): the kernels against the faster of the torch paths (segmented, stacked)
    that run without them. The bytes are what must move once: the rows' x, the adapters' A and B,
    y read and written."""
    from tandem.engine.lora.adapters import LoraAdapter
    from tandem.engine.lora.batch import LoraBatch
    from tandem.engine.lora.registry import Stack
    from tandem.kernels import reference

    g = torch.Generator(device="cuda").manual_seed(4)
    adapters = [LoraAdapter(f"a{i}", "", rank, 1.0, "", {(0, "qkv_proj"): (
        (torch.randn(rank, hidden, device="cuda", generator=g) * hidden ** -0.5).bfloat16(),
        (torch.randn(out, rank, device="cuda", generator=g) * rank ** -0.5).bfloat16())}) for i in range(count)]
    stack = Stack(adapters)
    seqs = [adapters[i % count] for i in range(tokens // per_seq)]
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    y = torch.randn(tokens, out, device="cuda", generator=g).bfloat16()
    y_ref = y.clone()
    kernel = LoraBatch.build(seqs, [per_seq] * len(seqs), torch.device("cuda"), stack)
    require(kernel.kernel_segments is not None, "the LoRA batch on CUDA does not take the kernels")
    kernel.apply(0, "qkv_proj", x, y)
    segs = kernel.kernel_segments
    a_all, b_all, layout = stack.weights[(0, "qkv_proj")]
    reference.lora(x, y_ref, a_all, b_all, stack.spans[layout][0], segs.rows, segs.starts, segs.slots)
    diff = (y.float() - y_ref.float()).abs().max().item()
    require(torch.allclose(y.float(), y_ref.float(), atol=BF16_ATOL, rtol=BF16_ATOL),
            f"LoRA kernels ({tokens} tokens) differ from the reference by {diff:.3g}")
    owner = torch.arange(tokens, device="cuda") // per_seq % count
    segmented = LoraBatch([(a, (owner == i).nonzero().flatten()) for i, a in enumerate(adapters)])
    stacked = LoraBatch(segmented.segments, stack, stack.masks([a.name for a in seqs for _ in range(per_seq)], "cuda"))
    torch_ms = {"segmented": bench_ms(lambda: segmented.apply(0, "qkv_proj", x, y_ref)),
                "stacked": bench_ms(lambda: stacked.apply(0, "qkv_proj", x, y_ref))}
    best = min(torch_ms, key=torch_ms.get)
    nbytes = (tokens * hidden + count * rank * (hidden + out) + 2 * tokens * out) * 2
    return rate("lora_shrink_expand", nbytes, bench_ms(lambda: kernel.apply(0, "qkv_proj", x, y)), torch_ms[best],
                peaks, torch_path=best, max_abs_diff=diff,
                shape=f"{tokens} tokens of {count} adapters, {hidden}->{out} rank {rank} bf16")


def run(report, args) -> None:
    from tandem.bench.gpu_check.gpu import datasheet_gbps, device_peak_gbps
    from tandem.bench.kernels import copy_gbps

    require(torch.cuda.is_available(), "torch sees no CUDA device")
    name = torch.cuda.get_device_name()
    copy = copy_gbps(torch.device("cuda"))
    sheet = datasheet_gbps(name)
    device, how = device_peak_gbps()
    peaks = {"peak": sheet or device, "device_peak": device, "copy": copy}
    d = report.details
    d.update(device=name, copy_gbps=copy, peak_gbps_datasheet=sheet, peak_gbps_device=device,
             peak_gbps_device_how=how, pct_of="triton_pct_peak: of the datasheet peak (the device's when "
             "unknown); _device_peak: of memory clock x bus width x 2; _copy: of the copy measured here",
             rows=[])
    print(f"{name}: datasheet {sheet} GB/s, device {device} GB/s ({how}), copy {copy} GB/s", flush=True)
    report.save()
    for step in (lambda: decode_attention(peaks, sheet or device), lambda: [rms_norm(peaks)],
                 lambda: [rope(peaks)], lambda: [kv_store(peaks)], lambda: kv_pack(peaks), lambda: lora(peaks)):
        for row in step():
            d["rows"].append(row)
            print(f"{row['kernel']:<18} {row['shape']:<64} triton {row['triton_gbps']:>8} GB/s "
                  f"({row['triton_pct_peak']}% of peak, {row['triton_pct_copy']}% of copy)  "
                  f"torch {row['torch_gbps']:>8} GB/s  x{row['speedup']}", flush=True)
        report.save()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main_of(run)
