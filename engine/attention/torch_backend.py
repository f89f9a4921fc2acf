"""Attention in plain torch: gather each sequence's KV pages into a padded batch, one SDPA call.

Works for decode (one query per sequence), prefill/extend (many queries attending causally to a
paged prefix plus themselves) and mixed batches. The gather copies whole pages (one contiguous
block each, `index_select` on the page axis) rather than single token slots: per-element advanced
indexing was a quarter of the decode step. The page index and mask are built once per step in
`prepare` and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, register_backend
from engine.forward_context import ForwardContext


@dataclass
class TorchAttnMetadata:
    pages: torch.Tensor             # [B * P] int64, each sequence's page ids, padded with page 0
    num_pages: int                  # P, pages per sequence after padding; Lk = P * page_size
    mask: torch.Tensor              # [B, 1, Lq, Lk] bool, True = attend
    q_index: torch.Tensor | None    # [B, Lq] token row of each (sequence, query); None for decode
    q_unpad: torch.Tensor | None    # [T] position in the flattened [B * Lq] output of each token


@register_backend("torch")
class TorchAttention(AttentionBackend):
    def prepare(self, ctx: ForwardContext) -> None:
        device = ctx.input_ids.device
        ps = self.pool.spec.page_size
        num_pages = -(-max(ctx.kv_lens) // ps)
        pages = ctx.page_table[:, :num_pages].to(torch.int64).reshape(-1)
        kv_pos = torch.arange(num_pages * ps, device=device)
        kv_lens = torch.tensor(ctx.kv_lens, device=device)
        if ctx.is_decode:
            mask = (kv_pos[None, :] < kv_lens[:, None])[:, None, None, :]
            ctx.attn_metadata = TorchAttnMetadata(pages, num_pages, mask, None, None)
            return
        max_q = max(ctx.q_lens)
        q_pos = torch.arange(max_q, device=device)
        q_lens = torch.tensor(ctx.q_lens, device=device)
        q_start = torch.cumsum(q_lens, 0) - q_lens
        valid_q = q_pos[None, :] < q_lens[:, None]                            # [B, Lq]
        q_index = torch.where(valid_q, q_start[:, None] + q_pos[None, :], 0)
        prefix = torch.tensor(ctx.prefix_lens, device=device)
        # Query i of a sequence sits at absolute position prefix + i and sees kv positions <= it.
        # Padded queries see position 0 at least, so no row of the softmax is empty (no NaN).
        q_abs = prefix[:, None] + q_pos[None, :]
        mask = (kv_pos[None, None, :] <= q_abs[:, :, None]) & (kv_pos[None, None, :] < kv_lens[:, None, None])
        b_idx = torch.arange(len(ctx.q_lens), device=device)
        q_unpad = (b_idx[:, None] * max_q + q_pos[None, :])[valid_q]
        ctx.attn_metadata = TorchAttnMetadata(pages, num_pages, mask[:, None], q_index, q_unpad)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        md: TorchAttnMetadata = ctx.attn_metadata
        self.pool.k_slots(layer)[ctx.out_slots] = k
        self.pool.v_slots(layer)[ctx.out_slots] = v
        batch, lk = len(ctx.kv_lens), md.num_pages * self.pool.spec.page_size
        kv_shape = (batch, lk, self.pool.spec.kv_heads, self.head_dim)
        keys = self.pool.k(layer).index_select(0, md.pages).view(kv_shape).transpose(1, 2)  # [B, KVH, Lk, D]
        values = self.pool.v(layer).index_select(0, md.pages).view(kv_shape).transpose(1, 2)
        if ctx.is_decode:
            queries = q.unsqueeze(2)                                          # [B, H, 1, D]
        else:
            queries = q[md.q_index].transpose(1, 2)                           # [B, H, Lq, D]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=md.mask, scale=self.scale, enable_gqa=True
        )
        if ctx.is_decode:
            return out.squeeze(2)
        return out.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim)[md.q_unpad]
