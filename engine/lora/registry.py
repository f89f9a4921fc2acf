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

    def get(self, name: str) -> LoraAdapter:
        """The adapter a request names. Raises InvalidRequest (param `model`) for an unknown one."""
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            what = "LoRA is off (--enable-lora)" if not self.enabled else f"adapters here: {known}"
            raise InvalidRequest(f"no LoRA adapter {name!r} ({what})", "model")
        return adapter
