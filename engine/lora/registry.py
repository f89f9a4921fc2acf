"""A worker's adapters: loaded at start from `--lora-modules name=path` (checked then: a bad one stops
the start with a message that names it), looked up by the name a request gives as its `model`."""

from __future__ import annotations

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.errors import InvalidRequest
from tandem.engine.lora.adapters import LoraAdapter, load_adapter
from tandem.engine.models.config import ModelConfig


class LoraRegistry:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.enabled = cfg.enable_lora
        self.max_loras = cfg.max_loras
        self.adapters: dict[str, LoraAdapter] = {}
        for name, path in cfg.lora_modules:
            self.adapters[name] = load_adapter(name, path, model_cfg, max_rank=cfg.max_lora_rank, dtype=dtype,
                                               device=device)
        self.stack = Stack(list(self.adapters.values())) if len(self.adapters) > 1 else None

    def get(self, name: str) -> LoraAdapter:
        """The adapter a request names. Raises InvalidRequest (param `model`) for an unknown one."""
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            what = "LoRA is off (--enable-lora)" if not self.enabled else f"adapters here: {known}"
            raise InvalidRequest(f"no LoRA adapter {name!r} ({what})", "model")
        return adapter


class Stack:
    """Every loaded adapter's blocks side by side, per (layer, fused projection): A_all `[S, in]`, B_all
    `[out, S]`, and the layout (adapter name -> its columns) that row masks follow (batch.py)."""

    def __init__(self, adapters: list[LoraAdapter]):
        self.count = len(adapters)
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, tuple]] = {}
        self._layouts: dict[tuple, tuple[tuple[str, int, int], ...]] = {}
        keys = sorted({k for a in adapters for k in a.blocks})
        for key in keys:
            a_parts, b_parts, layout, at = [], [], [], 0
            for adapter in adapters:
                block = adapter.blocks.get(key)
                if block is None:
                    continue
                a_parts.append(block[0])
                b_parts.append(block[1])
                layout.append((adapter.name, at, at + block[0].shape[0]))
                at += block[0].shape[0]
            layout_t = tuple(layout)
            self._layouts.setdefault(layout_t, layout_t)
            self.weights[key] = (torch.cat(a_parts).contiguous(), torch.cat(b_parts, dim=1).contiguous(), layout_t)

    def masks(self, owner: list[str | None], device) -> dict[tuple, torch.Tensor]:
        """Per layout, `[rows, S]`: 1 in each row's own adapter's columns (rows of the base model: 0)."""
        out = {}
        for layout in self._layouts:
            dtype = next(w[0].dtype for w in self.weights.values() if w[2] is layout)
            mask = torch.zeros(len(owner), layout[-1][2], dtype=dtype)
            cols = {name: (lo, hi) for name, lo, hi in layout}
            for row, name in enumerate(owner):
                if name in cols:
                    lo, hi = cols[name]
                    mask[row, lo:hi] = 1
            out[layout] = mask.to(device)
        return out
