"""Architecture name -> model class. New families register here, not in an if/elif chain."""

from __future__ import annotations

import torch

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM

MODELS: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[torch.nn.Module]:
    return MODELS[cfg.architecture]
