"""Attention in plain torch, shaped for CPUs: grouped-query matmuls for decode, SDPA per sequence for
prefill/extend.

Why not one padded SDPA call for the whole batch (the first version): on CPU, bf16
`scaled_dot_product_attention` with a mask takes a slow path for decode shapes — 4.8 ms per layer for
20 sequences x 320 keys on one core, where two grouped bf16 matmuls and an fp32 softmax take 0.26 ms
— and padding every sequence to the longest wastes the rest. So a step is split by shape:

- **Decode rows** (one query each) are sorted by length and cut into buckets whose padding stays
  under `MAX_PADDING`; per bucket, `q` viewed as `[b, kv_heads, group, D]` multiplies the gathered
  pages without repeating K/V, scores are softmaxed in fp32 and cast back for the PV matmul.
- **Prefill/extend rows** run one sequence at a time: a sequence with nothing cached attends to its
  own new K/V with `is_causal=True` (no gather, no mask: the fast SDPA path); one with a cached
  prefix (prefix-cache hit, a later chunk) gathers its pages and passes a bottom-right causal mask.
  These run in fp32 (on CPUs without AMX fp32 causal SDPA is as fast as bf16: 256 tokens 1.8 ms,
  1024 tokens 21 ms on one core, both dtypes, and the upcast is small next to it), except where
  `extend_attention` is "sdpa" (bf16 on AMX: see below), which keeps the pool's dtype.

The gather copies whole pages (`index_select` on the page axis), not single slots. All index tensors
and masks are built once per step in `prepare` and reused by every layer. Mixed batches (decode
rows next to a prefill chunk) take both paths in one step.

With the fused CPU kernels on (`cpu_ops`, kernels/cpu: the default where they build), decode rows
skip all of the above: `paged_decode_attention` reads each row's keys and values straight from its
pages (no gather, no buckets, no padding) and keeps scores and probabilities in fp32. Prefill/extend
rows with a head dim of 64 or 128 skip SDPA too, in every dtype and ISA variant:
`paged_extend_attention` reads the sequence's pages (no gather, no mask) with fp32 compute (bf16 pairs
into fp32 sums in the avx512_bf16 variant). It measured faster than the SDPA path at every shape
benchmarked (bench/cpu_kernels.py and smaller chunks: 17-2,048 new tokens, with and without a cached
prefix, fp32 and bf16, one core, Zen 4): 1.3-2.0x with the avx2 kernels against SDPA under the AVX2
emulation, 2.3-3.7x with the avx512_bf16 ones; so there is no shape rule, only what the kernel takes.
Other head dims run SDPA. On a Xeon with AMX (Emerald Rapids, 2026-12-05) the order flips: torch's
bf16 flash attention runs its GEMMs as oneDNN brgemm on AMX tiles, 256 new tokens in 0.46 ms per
layer against the kernel's 1.51, 1,024 in 4.75 against 18.6; there `extend_attention` is "sdpa"
(engine.hardware.choose_extend_attention) and prefill/extend rows run SDPA in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tandem.engine.attention.base import AttentionBackend, register_backend
from tandem.engine.forward_context import ForwardContext

# A decode bucket is closed when the next (shorter) sequence would be padded by more than this
# fraction of the bucket's length; each extra bucket costs ~6 small ops per layer.
MAX_PADDING = 0.5
# Extends of at most this many tokens over a cached prefix run as decode rows (see prepare).
MAX_EXPANDED_EXTEND = 16


@dataclass
class DecodeBucket:
    rows: torch.Tensor       # [b] token rows of these sequences' queries
    pages: torch.Tensor      # [b * P] page ids, padded with page 0
    num_pages: int           # P
    bias: torch.Tensor       # [b, 1, 1, P * page_size] fp32, 0 = attend, -inf = padding


@dataclass
class ExtendSeq:
    start: int               # first token row
    num_tokens: int
    pages: torch.Tensor | None   # [P] page ids when a cached prefix must be gathered, else None
    mask: torch.Tensor | None    # [num_tokens, P * page_size] bool (True = attend), with pages
    table: torch.Tensor | None = None   # [P] int32 page ids for the extend kernel (then no pages/mask)
    kv_len: int = 0                     # keys in those pages, this chunk's included


@dataclass
class KernelRows:
    """Decode rows for the fused CPU kernel: row i reads `tables[i]`'s pages up to `kv_lens[i]`."""
    rows: torch.Tensor | None    # [R] token rows, None when they are every row of the step, in order
    tables: torch.Tensor         # [R, P] int32
    kv_lens: torch.Tensor        # [R] int64


@dataclass
class TorchAttnMetadata:
    decode: list[DecodeBucket] = field(default_factory=list)
    extend: list[ExtendSeq] = field(default_factory=list)
    kernel: KernelRows | None = None
    store_at: torch.Tensor | None = None   # the pool rows of each new token's K and V, per layer (store_rows)


@register_backend("torch")
class TorchAttention(AttentionBackend):
    def __init__(self, pool, num_heads: int, head_dim: int, scale: float | None = None):
        super().__init__(pool, num_heads, head_dim, scale)
        # [KVH * D, H] 0/1: row block j (KV head j's dims) is 1 for the query heads that read it.
        kvh = pool.spec.kv_heads
        group = torch.ones(head_dim, num_heads // kvh, dtype=pool.spec.dtype, device=pool.buffer.device)
        self._block_mask = torch.block_diag(*[group] * kvh)
        self.cpu_ops = None   # kernels.cpu's module when the fused CPU kernels are on (set by ModelRunner)
        # Prefill/extend rows (set by ModelRunner from engine.hardware.choose_extend_attention): "kernel",
        # the paged kernel where cpu_ops take the pool's dtype (else SDPA in fp32); "sdpa", torch's SDPA
        # in the pool's dtype.
        self.extend_attention = "kernel"

    def prepare(self, ctx: ForwardContext) -> None:
        device = ctx.input_ids.device
        ps = self.pool.spec.page_size
        md = TorchAttnMetadata(store_at=self.pool.store_rows(ctx.out_slots))
        starts, row = [], 0
        for n in ctx.q_lens:
            starts.append(row)
            row += n
        table = ctx.page_table
        # Decode rows: (token row, its kv length, its sequence). A short extend over a cached
        # prefix (a speculative verify row: last token + k drafts) runs as one decode row per token,
        # each seeing the keys up to itself: the batched decode path instead of one SDPA per
        # sequence, and the same arithmetic per token as plain decoding.
        rows: list[tuple[int, int, int]] = []
        for i, n in enumerate(ctx.q_lens):
            if n == 1 or (n <= MAX_EXPANDED_EXTEND and ctx.prefix_lens[i] > 0):
                rows.extend((starts[i] + j, ctx.prefix_lens[i] + j + 1, i) for j in range(n))
        if rows and self.cpu_ops is not None:
            md.kernel = KernelRows(
                rows=None if len(rows) == ctx.input_ids.shape[0] else torch.tensor([r[0] for r in rows], device=device),
                tables=table.index_select(0, torch.tensor([r[2] for r in rows], device=device)),
                kv_lens=torch.tensor([r[1] for r in rows], dtype=torch.int64, device=device))
        else:
            md.decode = self._decode_buckets(rows, table)
        extend_kernel = self._extend_kernel()
        for i, n in enumerate(ctx.q_lens):
            if n == 1 or (n <= MAX_EXPANDED_EXTEND and ctx.prefix_lens[i] > 0):
                continue
            if extend_kernel:
                kv_len = ctx.kv_lens[i]
                md.extend.append(ExtendSeq(starts[i], n, None, None, table[i, :-(-kv_len // ps)], kv_len))
                continue
            prefix = ctx.prefix_lens[i]
            if prefix == 0:
                md.extend.append(ExtendSeq(starts[i], n, None, None))
                continue
            num_pages = -(-ctx.kv_lens[i] // ps)
            kv_pos = torch.arange(num_pages * ps, device=device)
            q_abs = prefix + torch.arange(n, device=device)
            mask = (kv_pos[None, :] <= q_abs[:, None])     # also hides the page's tail past kv_len
            pages = table[i, :num_pages].to(torch.int64)
            md.extend.append(ExtendSeq(starts[i], n, pages, mask))
        ctx.attn_metadata = md

    def _extend_kernel(self) -> bool:
        """Whether prefill/extend rows run `paged_extend_attention`: wherever it takes the pool's dtype
        and head dim (fp32, bf16, fp16; 64 or 128), since in fp32 and bf16 it measured faster than the
        SDPA path at every length and prefix benchmarked (see the module docstring; fp16 unmeasured)."""
        ops = self.cpu_ops
        return (self.extend_attention == "kernel" and ops is not None
                and ops.extend_attention_supported(self.pool.spec.dtype, self.head_dim))

    def _decode_buckets(self, rows: list[tuple[int, int, int]], table: torch.Tensor) -> list[DecodeBucket]:
        """Decode rows (token row, kv length, sequence) for the grouped-matmul path, in length buckets."""
        device, ps = table.device, self.pool.spec.page_size
        buckets = []
        for bucket in self._buckets(list(range(len(rows))), [r[1] for r in rows]):
            num_pages = -(-max(rows[r][1] for r in bucket) // ps)
            idx = torch.tensor([rows[r][2] for r in bucket], device=device)
            kv_pos = torch.arange(num_pages * ps, device=device)
            lens = torch.tensor([rows[r][1] for r in bucket], device=device)
            bias = torch.zeros(len(bucket), 1, 1, num_pages * ps, device=device)
            bias.masked_fill_((kv_pos[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
            buckets.append(DecodeBucket(
                rows=torch.tensor([rows[r][0] for r in bucket], device=device),
                pages=table.index_select(0, idx)[:, :num_pages].to(torch.int64).reshape(-1),
                num_pages=num_pages, bias=bias))
        return buckets

    @staticmethod
    def _buckets(decode: list[int], kv_lens: list[int]) -> list[list[int]]:
        """Decode rows grouped by length so that padding stays under MAX_PADDING; a single
        bucket keeps batch order (its rows are then the step's rows as they are)."""
        order = sorted(decode, key=lambda i: -kv_lens[i])
        buckets = []
        while order:
            floor = (1 - MAX_PADDING) * kv_lens[order[0]]
            cut = next((j for j, i in enumerate(order) if kv_lens[i] < floor), len(order))
            buckets.append(order[:cut])
            order = order[cut:]
        return [decode] if len(buckets) == 1 else buckets

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        md: TorchAttnMetadata = ctx.attn_metadata
        self.pool.store(layer, k, v, md.store_at)
        if md.kernel is not None and md.kernel.rows is None:     # every row decodes, in order
            return self._decode_kernel(layer, q, md.kernel)
        if not md.extend and len(md.decode) == 1 and md.decode[0].rows.shape[0] == q.shape[0]:
            return self._decode(layer, q, md.decode[0])   # pure decode, one bucket: rows are in order
        out = torch.empty_like(q)
        if md.kernel is not None:
            rows = md.kernel.rows
            out.index_copy_(0, rows, self._decode_kernel(layer, q.index_select(0, rows), md.kernel))
        for bucket in md.decode:
            out.index_copy_(0, bucket.rows, self._decode(layer, q.index_select(0, bucket.rows), bucket))
        for seq in md.extend:
            rows = slice(seq.start, seq.start + seq.num_tokens)
            out[rows] = self._extend(layer, q[rows], k[rows], v[rows], seq)
        return out

    def _gather(self, layer: int, pages: torch.Tensor, batch: int, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `pages` as `[batch, kv_heads, num_pages * page_size, D]` (copies whole pages)."""
        spec = self.pool.spec
        shape = (batch, num_pages * spec.page_size, spec.kv_heads, self.head_dim)
        keys = self.pool.k(layer).index_select(0, pages).view(shape).transpose(1, 2)
        values = self.pool.v(layer).index_select(0, pages).view(shape).transpose(1, 2)
        return keys, values

    def _decode_kernel(self, layer: int, q: torch.Tensor, rows: KernelRows) -> torch.Tensor:
        return self.cpu_ops.paged_decode_attention(q, self.pool.k(layer), self.pool.v(layer), rows.tables,
                                                   rows.kv_lens, self.scale)

    def _decode(self, layer: int, q: torch.Tensor, bucket: DecodeBucket) -> torch.Tensor:
        # Scores as K @ Q_blk over the pages' natural [b, L, KVH * D] layout: Q_blk holds each query
        # head's vector in its KV head's block of rows (zeros elsewhere), so no K transpose is
        # copied and the matmul's long side is L (a [G, D] x [D, L] product per head is 4-5x slower
        # on CPU). The zero blocks triple the flops of a tiny matmul; the copies they save are not tiny.
        spec = self.pool.spec
        b, kvh, d = q.shape[0], spec.kv_heads, self.head_dim
        length = bucket.num_pages * spec.page_size
        keys = self.pool.k(layer).index_select(0, bucket.pages).view(b, length, kvh * d)
        values = self.pool.v(layer).index_select(0, bucket.pages).view(b, length, kvh, d)
        q_blk = q.transpose(1, 2).repeat(1, kvh, 1).mul_(self._block_mask)  # [b, KVH * D, H]
        scores = torch.bmm(keys, q_blk).float()                                 # [b, L, H]
        probs = torch.softmax(scores.transpose(1, 2) * self.scale + bucket.bias.view(b, 1, length), dim=-1)
        probs = probs.to(values.dtype).view(b, kvh, self.num_heads // kvh, length)
        return torch.matmul(probs, values.transpose(1, 2)).view(b, self.num_heads, d)

    def _extend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                seq: ExtendSeq) -> torch.Tensor:
        if seq.table is not None:
            return self.cpu_ops.paged_extend_attention(q, self.pool.k(layer), self.pool.v(layer), seq.table,
                                                       seq.kv_len, self.scale)
        dt = q.dtype if self.extend_attention == "sdpa" else torch.float32
        queries = q.transpose(0, 1).unsqueeze(0).to(dt)                        # [1, H, n, D]
        if seq.pages is None:
            keys, values = k.transpose(0, 1).unsqueeze(0).to(dt), v.transpose(0, 1).unsqueeze(0).to(dt)
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=self.scale,
                                                 enable_gqa=True)
        else:
            keys, values = self._gather(layer, seq.pages, 1, seq.pages.shape[0])
            out = F.scaled_dot_product_attention(queries, keys.to(dt), values.to(dt), attn_mask=seq.mask,
                                                 scale=self.scale, enable_gqa=True)
        return out[0].transpose(0, 1).to(q.dtype)                              # [n, H, D]
