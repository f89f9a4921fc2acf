"""CPU linear layers on weights packed once at load time: oneDNN's blocked layout for bf16, the panel
layout of Tandem's own fp32 kernel (kernels/cpu/linear.cpp) for fp32.

**bf16 (`PackedLinear`).**

`F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which it reorders into its
blocked layout on every call: each decode step then reads every weight twice and writes it once.
At the batch sizes decode runs (1-32 rows) a step is bound by streaming the weights, so that
reorder costs about as much as the matmul. `torch.ops.mkldnn._reorder_linear_weight` does it once;
`torch.ops.mkldnn._linear_pointwise` then multiplies by the packed tensor. Same kernel, same
accumulation order: the outputs are bit-identical to `F.linear` (tests/engine/models/test_prepack.py).

Measured on the 2-core box (one thread, SmolLM2's 30 layers of projections, weights streamed from
DRAM as in a real step): 29.2 -> 17.0 ms at 1 row, 35.6 -> 18.3 ms at 8, 62.2 -> 42.5 ms at 32,
303 -> 289 ms at 256; the tied vocab projection 6.2 -> 3.2 ms at 1 row (docs/benchmarks.md).

**fp32 (`PanelLinear`).** The projections are ~95% of an fp32 decode step, and at the row counts
decode runs (1-64) MKL's and oneDNN's fp32 GEMMs use a third to a half of the core: SmolLM2's
projections at 8 rows ran 25-38 GFLOP/s on an AVX2 core that does ~115. `ops.linear` (kernels/cpu/
linear.cpp) multiplies by a weight packed once into panels of 16 (AVX2) or 32 (AVX-512) output
columns, streaming each panel once per block of up to 6 or 14 rows with the accumulators in
registers and the stream prefetched: 74-82 GFLOP/s at 8 rows there (2.1-2.7x the faster library),
1.2-1.3x at 64 rows, 1.05-1.1x at 256 (bench/cpu_kernels.py --parts linear, Zen 5 under the AVX2
emulation; with AVX-512 2.3-2.8x at 8 rows, 1.1x at 256). There is no crossover to a library:
the kernel was at least as fast as oneDNN on a prepacked weight (the faster of the two) at every
row count measured, 1 to 8,192 (a tie at most, gate/up at 8,192 rows), on both levels, so the
panels are the only copy of each weight (the model's fp32 tensors: 515 MiB with or without them),
and of a tied embedding too (`PanelEmbedding` reads the vocab projection's panels). Numerics: each
output is one fp32 sum over k in order, not MKL's order: within fp32 rounding of `F.linear`, not
bit-identical; greedy outputs still match Hugging Face's (tests/engine/test_engine_vs_hf.py,
test_smollm2.py).

Used by default on CPU (bf16 where oneDNN supports it, fp32 where the CPU kernels build) and not
under decode graphs (inductor handles its own weights); `--disable-weight-prepack` turns it off.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch


def prepack_supported(device: torch.device, dtype: torch.dtype, cpu_kernels: bool = False) -> bool:
    """Whether `dtype` linears on `device` can be prepacked (engine/hardware.py decides); fp32 needs the
    CPU kernels (`cpu_kernels`: they are loaded)."""
    from tandem.engine.hardware import choose_weight_prepack, detect

    return bool(choose_weight_prepack(detect(device), dtype, graphs=False, cpu_kernels=cpu_kernels).value)


class PackedLinear(torch.nn.Module):
    """`y = x Wᵀ + b` with W held only in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class PanelLinear(torch.nn.Module):
    """`y = x Wᵀ + b` in fp32 with W held only in the panel layout of `ops.linear` (kernels/cpu: the
    module of the variant this process runs, whose panel width the packing used)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.ops = ops
        self.packed = ops.pack_linear(weight.detach())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = self.ops.linear(rows, self.packed, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] `[*ids.shape, in]`, read from the packed panels (an embedding tied to this projection)."""
        panel = self.packed.shape[2]
        flat = ids.reshape(-1)
        return self.packed[flat // panel, :, flat % panel].view(*ids.shape, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, panel={self.packed.shape[2]}"


class PanelEmbedding(torch.nn.Module):
    """An embedding whose table is a `PanelLinear`'s packed weight (tied word embeddings): the same
    values as `nn.Embedding`, without a second copy of the table."""

    def __init__(self, projection: PanelLinear):
        super().__init__()
        self.projection = projection

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.projection.rows(ids)


def linear_packer(ops=None) -> Callable[[torch.Tensor, torch.Tensor | None], torch.nn.Module]:
    """What packs one linear: `PanelLinear` on `ops` (kernels.cpu, fp32), else `PackedLinear` (bf16)."""
    return PackedLinear if ops is None else partial(PanelLinear, ops=ops)


def prepack_linears(model: torch.nn.Module, ops=None) -> int:
    """Replace every `nn.Linear` under `model` by its packed form (`linear_packer(ops)`; the dense
    weight is freed). Returns how many were replaced."""
    pack = linear_packer(ops)
    swaps = [(parent, name) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is torch.nn.Linear]
    with torch.no_grad():
        for parent, name in swaps:   # no list holds the old layers: each plain weight is freed once packed
            child = getattr(parent, name)
            setattr(parent, name, pack(child.weight, child.bias))
    return len(swaps)
