"""The model families Tandem runs: architecture name (config.json's `architectures[0]`) -> the class
that runs it and the switches that set the family apart from plain Llama. Adding a family is one
entry here, not an if/elif chain. Torch-free: `ModelConfig` reads the switches (the gateway reads
model folders too); the runner imports the class when it builds the model."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from tandem.engine.models.config import ModelConfig


@dataclass(frozen=True)
class Architecture:
    module: str               # engine.models.<module> defines `cls`
    cls: str
    qkv_bias: bool = False    # biases on the q/k/v projections (also when config.json says attention_bias)
    qk_norm: bool = False     # RMSNorm over each head of q and k before RoPE


_LLAMA = "llama", "LlamaForCausalLM"

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(*_LLAMA),
    "MistralForCausalLM": Architecture(*_LLAMA),
    "Qwen2ForCausalLM": Architecture(*_LLAMA, qkv_bias=True),
    "Qwen3ForCausalLM": Architecture(*_LLAMA, qk_norm=True),
}


def model_class(cfg: ModelConfig) -> type[torch.nn.Module]:
    arch = ARCHITECTURES[cfg.architecture]
    return getattr(importlib.import_module(f"tandem.engine.models.{arch.module}"), arch.cls)
