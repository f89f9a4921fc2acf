"""CPU linear layers on prepacked weights (oneDNN's blocked layout), reordered once at load time.

`F.linear` on a bf16 CPU tensor hands oneDNN a plain row-major weight, which it reorders into its
blocked layout on every call: each decode step then reads every weight twice and writes it once.
At the batch sizes decode runs (1-32 rows) a step is bound by streaming the weights, so that
reorder costs about as much as the matmul. `torch.ops.mkldnn._reorder_linear_weight` does it once;
`torch.ops.mkldnn._linear_pointwise` then multiplies by the packed tensor. Same kernel, same
accumulation order: the outputs are bit-identical to `F.linear` (tests/engine/models/test_prepack.py).

Measured on the 2-core box (one thread, SmolLM2's 30 layers of projections, weights streamed from
DRAM as in a real step): 29.2 -> 17.0 ms at 1 row, 35.6 -> 18.3 ms at 8, 62.2 -> 42.5 ms at 32,
303 -> 289 ms at 256; the tied vocab projection 6.2 -> 3.2 ms at 1 row (docs/benchmarks.md).

Used for bf16 on CPU when oneDNN supports bf16 there, and not under decode graphs (inductor
handles its own weights); `--disable-weight-prepack` turns it off.
"""

from __future__ import annotations

import torch


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `dtype` linears on `device` can be prepacked (engine/hardware.py decides)."""
    from engine.hardware import choose_weight_prepack, detect

    return bool(choose_weight_prepack(detect(device), dtype, graphs=False).value)


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


def prepack_linears(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by a `PackedLinear` (its dense weight is freed).
    Returns how many were replaced."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is torch.nn.Linear]
    with torch.no_grad():
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(swaps)
