"""A step's LoRA: which rows of the flattened tokens use which adapter, applied after each projection.

Rows of the same adapter are gathered, multiplied by its A and B (two thin matmuls: `[n, in] @ [in, r]`
then `[n, r] @ [r, out]`) and added into their slice of the fused output; base-model rows are not
touched. One forward serves requests of different adapters and the base model together (S-LoRA /
Punica's segmented LoRA in plain torch: the reference, and what runs on CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.lora.adapters import LoraAdapter


class LoraBatch:
    def __init__(self, segments: list[tuple[LoraAdapter, torch.Tensor | None]]):
        """`segments`: (adapter, its rows; None: every row of the step)."""
        self.segments = segments

    @staticmethod
    def build(adapters: Sequence[LoraAdapter | None], q_lens: Sequence[int], device) -> LoraBatch | None:
        """The step's batch from each sequence's adapter (None: base model) and its token count; None
        when no sequence uses one."""
        rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
        start = 0
        for adapter, n in zip(adapters, q_lens, strict=True):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + n))
            start += n
        if not rows:
            return None
        return LoraBatch([(a, None if len(r) == start else torch.tensor(r, dtype=torch.int64, device=device))
                          for a, r in rows.values()])

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add every adapter's delta of projection `proj` of `layer` (input `x`, output `y`) into `y`."""
        for adapter, rows in self.segments:
            mods = adapter.mods.get((layer, proj))
            if not mods:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            for offset, a, b in mods:
                delta = (xs @ a.t()) @ b.t()
                delta.mul_(adapter.scaling)
                out = y[:, offset:offset + b.shape[0]]
                if rows is None:
                    out.add_(delta)
                else:
                    out.index_add_(0, rows, delta)
