"""Plain-torch references for every kernel: the definitions the kernels are tested against.

They favour obviousness over speed (Python loops over sequences) and compute in fp32, casting the
result to the storage dtype once, as the kernels do.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` token rows of one sequence: cache [P, ps, KVH, D] -> [length, KVH, D]."""
    ps = cache.shape[1]
    n_pages = -(-length // ps)
    return cache[pages[:n_pages].long()].reshape(n_pages * ps, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None):
    """q [Lq, H, D], k/v [Lk, KVH, D] -> [Lq, H, D] fp32. Query i sees keys <= causal_offset + i."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal_offset is not None:
        qi = torch.arange(q.shape[0])[:, None]
        ki = torch.arange(k.shape[0])[None, :]
        scores = scores.masked_fill(ki > causal_offset + qi, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, kv_lens: list[int], scale: float) -> torch.Tensor:
    """q [B, H, D]: sequence b's single query attends to its first kv_lens[b] cached tokens."""
    out = torch.empty_like(q)
    for b, length in enumerate(kv_lens):
        k = gather_kv(k_cache, page_table[b], length)
        v = gather_kv(v_cache, page_table[b], length)
        out[b] = _attend(q[b:b + 1], k, v, scale, None)[0].to(q.dtype)
    return out


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, q_lens: list[int], prefix_lens: list[int],
                     scale: float) -> torch.Tensor:
    """q [T, H, D] flattened over sequences; the new tokens' K/V are already in the cache."""
    out = torch.empty_like(q)
    start = 0
    for b, (n, prefix) in enumerate(zip(q_lens, prefix_lens, strict=True)):
        k = gather_kv(k_cache, page_table[b], prefix + n)
        v = gather_kv(v_cache, page_table[b], prefix + n)
        out[start:start + n] = _attend(q[start:start + n], k, v, scale, prefix).to(q.dtype)
        start += n
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Row t of k/v goes to slot `slots[t]` (page * page_size + offset); negative slots are skipped."""
    keep = slots >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slots[keep]] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots[keep]] = v[keep].to(v_cache.dtype)


def _by_layer(buffer: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """A page-first pool `[P, L, 2, ...]` seen as the layer-first `[L, 2, P, ...]` (a view)."""
    return buffer.movedim(0, 2) if kv_layout == "page_first" else buffer


def pack_kv_pages(buffer: torch.Tensor, page_ids: torch.Tensor, layout: str = "NHD",
                  kv_layout: str = "layer_first") -> torch.Tensor:
    """buffer [L, 2, P, ps, KVH, D] (or page-first [P, L, 2, ps, KVH, D]) -> staging [L, 2, N, ps, KVH, D]
    (NHD) or [L, 2, N, KVH, ps, D] (HND)."""
    staged = _by_layer(buffer, kv_layout)[:, :, page_ids.long()]
    return staged.transpose(3, 4).contiguous() if layout == "HND" else staged.contiguous()


def unpack_kv_pages(staging: torch.Tensor, buffer: torch.Tensor, page_ids: torch.Tensor,
                    layout: str = "NHD", kv_layout: str = "layer_first") -> None:
    src = staging.transpose(3, 4) if layout == "HND" else staging
    _by_layer(buffer, kv_layout)[:, :, page_ids.long()] = src


def lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, spans: torch.Tensor,
         rows: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`y[rows of s] += (x[rows of s] @ a[cols].T) @ b[:, cols].T` per segment s, its adapter's columns
    `cols = spans[slot] = (start, rank)`; in place. Returns the fp32 shrink result `[n, max rank]`
    (zeros past each segment's rank), what kernels.lora's partial sums add up to."""
    spans_, starts_, slots_ = spans.tolist(), starts.tolist(), slots.tolist()
    xa = torch.zeros(rows.shape[0], max([r for _, r in spans_], default=0), device=x.device)
    for s, slot in enumerate(slots_):
        col, rank = spans_[slot]
        idx = rows[starts_[s]:starts_[s + 1]].long()
        if rank == 0 or idx.numel() == 0:
            continue
        part = x[idx].float() @ a[col:col + rank].float().T
        xa[starts_[s]:starts_[s + 1], :rank] = part
        y[idx] = (y[idx].float() + part @ b[:, col:col + rank].float().T).to(y.dtype)
    return xa


def lora_parts(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, slots: torch.Tensor,
               parts: torch.Tensor, first_part: torch.Tensor) -> None:
    """The CPU kernel's `lora_` (kernels/cpu/lora.cpp), in place: for each adapter s, its rows
    (`slots == s`) and each of its parts `(col, rank, out, len)`: `xa = x[rows] @ a[col:col + rank].T`
    in fp32, rounded to the dtype (as torch's `x @ a.t()`), then `y[rows, out:out + len] += xa @
    b_t[col:col + rank, out:out + len]` in fp32, rounded once."""
    parts_, first_ = parts.tolist(), first_part.tolist()
    for s in range(len(first_) - 1):
        idx = (slots == s).nonzero()[:, 0]
        for col, rank, out, n in parts_[first_[s]:first_[s + 1]]:
            if idx.numel() == 0 or rank == 0 or n == 0:
                continue
            xa = (x[idx].float() @ a[col:col + rank].float().T).to(x.dtype).float()
            cols = slice(out, out + n)
            y[idx, cols] = (y[idx, cols].float() + xa @ b_t[col:col + rank, cols].float()).to(y.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """As engine.models.layers.RMSNorm: normalise in fp32, cast to the weight's dtype, then scale."""
    if residual is not None:
        residual = residual + x
        x = residual
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype)
    return y if residual is None else (y, residual)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half RoPE; cos/sin [T, D/2] rows for each token. Returns new q, k in their dtypes."""
    def rot(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        xf = x.float()
        c, s = cos[:, None, :].float(), sin[:, None, :].float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return rot(q), rot(k)
