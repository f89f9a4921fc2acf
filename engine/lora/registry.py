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
    `[out, S]`, and its layout (which adapter each of the S columns belongs to) that row masks follow."""

    def __init__(self, adapters: list[LoraAdapter]):
        self.count = len(adapters)
        self.index = {a.name: i for i, a in enumerate(adapters)}
        # (layer, projection) -> (A_all, B_all, layout id); layout id -> (owner of each column, dtype)
        self.weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._columns: list[tuple[torch.Tensor, torch.dtype]] = []
        layouts: dict[tuple[int, ...], int] = {}
        for key in sorted({k for a in adapters for k in a.blocks}):
            present = [(i, a.blocks[key]) for i, a in enumerate(adapters) if key in a.blocks]
            a_all = torch.cat([a for _, (a, _) in present]).contiguous()
            layout = tuple(i for i, (a, _) in present for _ in range(a.shape[0]))
            if layout not in layouts:
                layouts[layout] = len(self._columns)
                self._columns.append((torch.tensor(layout, dtype=torch.int64), a_all.dtype))
            self.weights[key] = (a_all, torch.cat([b for _, (_, b) in present], dim=1).contiguous(), layouts[layout])

    def masks(self, owner: list[str | None], device) -> list[torch.Tensor]:
        """Per layout id, `[rows, S]`: 1 in each row's own adapter's columns (rows of the base model: 0)."""
        rows = torch.tensor([self.index.get(name, -1) if name is not None else -1 for name in owner],
                            dtype=torch.int64)
        return [(rows[:, None] == cols[None, :]).to(device=device, dtype=dtype) for cols, dtype in self._columns]
