"""Attention with Triton kernels: new K/V stored into their pages, then paged attention read in place.

Decode batches run `kernels.decode_attention` (GQA-grouped, split-K for long contexts); prefill,
chunked-prefill and mixed batches run `kernels.extend_attention` (causal over the paged prefix and
the new tokens). Nothing is gathered into a padded batch, unlike the torch backend.

The default (`auto`) on CUDA. On CPU it runs only under `TRITON_INTERPRET=1` (set before the
process imports the kernels), for correctness checks: the interpreter is ~1000x slower than torch.
On CUDA, creating this backend also routes RMSNorm (+residual) and RoPE to their fused kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention.base import AttentionBackend, register_backend
from tandem.engine.forward_context import ForwardContext
from tandem.kernels.decode_attention import default_num_splits, paged_decode_attention, runs_in_interpreter
from tandem.kernels.extend_attention import extend_attention
from tandem.kernels.kv_store import store_kv


@dataclass
class TritonAttnMetadata:
    kv_lens: torch.Tensor          # [B] int32
    max_kv_len: int
    num_splits: int                # decode only
    q_start: torch.Tensor          # [B] int32, first row of each sequence in the flattened tokens
    q_lens: torch.Tensor           # [B] int32
    prefix_lens: torch.Tensor      # [B] int32
    max_q_len: int


@register_backend("triton")
class TritonAttention(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, pool, num_heads: int, head_dim: int, scale: float | None = None):
        super().__init__(pool, num_heads, head_dim, scale)
        device = pool.buffer.device
        if device.type != "cuda" and not runs_in_interpreter():
            raise ValueError("attention backend 'triton' needs a CUDA device; on CPU it runs only under "
                             "TRITON_INTERPRET=1 (correctness checks, ~1000x slower than "
                             "--attention-backend torch)")
        if device.type == "cuda":
            from tandem.engine.models import layers, rope
            from tandem.kernels.rmsnorm import rms_norm
            from tandem.kernels.rope import apply_rope

            layers.use_fused_rms_norm(rms_norm)
            rope.use_fused_rope(apply_rope)

    def prepare(self, ctx: ForwardContext) -> None:
        q_start, start = [], 0
        for n in ctx.q_lens:
            q_start.append(start)
            start += n
        # One host-to-device copy for all four per-sequence vectors.
        host = torch.tensor([ctx.kv_lens, ctx.q_lens, ctx.prefix_lens, q_start], dtype=torch.int32)
        dev = host.to(ctx.input_ids.device, non_blocking=True)
        max_kv = max(ctx.kv_lens)
        splits = 1
        if ctx.is_decode:
            splits = default_num_splits(ctx.batch_size, self.pool.spec.kv_heads, max_kv, dev.device)
        ctx.attn_metadata = TritonAttnMetadata(
            kv_lens=dev[0], max_kv_len=max_kv, num_splits=splits,
            q_start=dev[3], q_lens=dev[1], prefix_lens=dev[2], max_q_len=max(ctx.q_lens),
        )

    def graph_metadata(self, ctx: ForwardContext, kv_lens: torch.Tensor, max_kv_len: int) -> TritonAttnMetadata:
        """Decode metadata for a CUDA graph of `ctx` (static buffers): `kv_lens` is rewritten before each
        replay; `max_kv_len` bounds every replay and sizes the splits (a split past a sequence's
        length exits at once, a row of length 0 attends to nothing and writes zeros)."""
        b, dev = ctx.batch_size, kv_lens.device
        splits = default_num_splits(b, self.pool.spec.kv_heads, max_kv_len, dev)
        # Only the decode fields are read by a decode forward; the rest keep the dataclass whole.
        unused = torch.zeros(b, dtype=torch.int32, device=dev)
        return TritonAttnMetadata(kv_lens=kv_lens, max_kv_len=max_kv_len, num_splits=splits,
                                  q_start=unused, q_lens=unused, prefix_lens=unused, max_q_len=1)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        md: TritonAttnMetadata = ctx.attn_metadata
        k_cache, v_cache = self.pool.k(layer), self.pool.v(layer)
        store_kv(k, v, k_cache, v_cache, ctx.out_slots)
        if ctx.is_decode:
            return paged_decode_attention(q, k_cache, v_cache, ctx.page_table, md.kv_lens, self.scale,
                                          max_kv_len=md.max_kv_len, num_splits=md.num_splits)
        return extend_attention(q, k_cache, v_cache, ctx.page_table, md.q_start, md.q_lens,
                                md.prefix_lens, self.scale, max_q_len=md.max_q_len)
