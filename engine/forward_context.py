"""Per-step metadata: built once per forward pass by the model runner, read by every layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandem.engine.attention.base import AttentionBackend


@dataclass
class ForwardContext:
    """Everything a layer needs to know about the batch being run.

    Tokens of all sequences are flattened: sequence `i` owns rows
    `q_start[i] : q_start[i] + q_lens[i]` of `input_ids`; it already had `prefix_lens[i]` tokens of
    KV in the pool before this step, and after the step holds `kv_lens[i] = prefix_lens[i] + q_lens[i]`.
    """

    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64, absolute position of each token
    out_slots: torch.Tensor        # [T] int64, KV slot (page * page_size + offset) each new token writes
    logits_indices: torch.Tensor   # [S] int64, rows whose logits are needed (last token of sampling seqs)
    page_table: torch.Tensor       # [B, max_pages] int32, the pages of each sequence (padded with 0)
    q_lens: list[int]
    prefix_lens: list[int]
    kv_lens: list[int]
    is_decode: bool                # every sequence runs exactly one new token
    attn: AttentionBackend
    attn_metadata: Any = None      # backend-specific tensors, built by `attn.prepare(ctx)`
    # Called with each layer's index right after it ran, its KV in the pool on a CPU device (on CUDA
    # only queued): a prefill worker sends that layer's pages while the next layers compute.
    after_layer: Callable[[int], None] | None = None
    lora: Any = None               # engine.lora.batch.LoraBatch: which rows use which adapter (None: none)

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
