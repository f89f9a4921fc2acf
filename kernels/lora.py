"""Mixed-adapter LoRA: every adapter's rows of a step in two launches per projection, shrink and expand.

One step mixes tokens of several adapters and of the base model. Each adapter's weights of a
projection sit side by side in one stacked pair (engine/lora/registry.py `Stack`): `a [S, in]`,
`b [out, S]`, adapter slot i owning columns `spans[i] = (start, rank)` (rank 0: that adapter does
not adapt this projection). The step's tokens are grouped into `Segments`, one per adapter used:
`rows[starts[s]:starts[s + 1]]` are the token rows of segment s, whose adapter slot is `slots[s]`.
Rows in no segment (the base model's) are neither read nor written.

- `lora_shrink`: `xa[p] = x[rows[p]] @ a[cols(slot)]^T`, fp32, in row-position order. The input
  dimension is split across programs (split-K): a decode step has one row per sequence and a few
  segments, which alone would leave most SMs idle while each streams a whole `a` block. Each split
  writes its partial sum; no atomics, so the result does not depend on scheduling.
- `lora_expand`: `y[rows[p]] += (sum of the partials of p) @ b[:, cols(slot)]^T`. A row belongs to
  one segment, so no two programs write one element of `y`.

Punica's SGMV and S-LoRA's MBGMM do the same with contiguous segments; here a segment's rows are
gathered through `rows`, since a step's sequences of one adapter interleave with others' and the
model's activations are not reordered for LoRA. Programs of a segment's spare row tiles (the grid is
sized by the longest segment, known on the host without a device sync) return at once.

Arithmetic is fp32: fp32 inputs use IEEE dots (no TF32); fp16/bf16 tiles go to the tensor cores
with fp32 accumulation, the shrink result rounded to the input dtype before the expand dot, as the
torch path rounds `x @ a.T` (on CPU the interpreter upcasts bf16 first, `common.upcast`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.kernels.common import check, check_tensor, next_pow2, upcast

BLOCK_K = 64            # input columns per shrink step
BLOCK_N = 64            # output columns per expand program
MAX_BLOCK_R = 64        # adapter columns per tile; higher ranks loop over tiles
TARGET_PROGRAMS = 256   # shrink programs to aim for with split-K (about two waves of 132 SMs)
MAX_SPLIT = 32


@triton.jit
def _segment_tile(Starts, Slots, Spans, BLOCK_M: tl.constexpr):
    """This program's segment: the positions in `Rows` where its row tile starts and the segment ends,
    and the segment's adapter's first column and rank in the stacked weights."""
    seg = tl.program_id(0)
    first = tl.load(Starts + seg) + tl.program_id(1) * BLOCK_M
    end = tl.load(Starts + seg + 1)
    slot = tl.load(Slots + seg)
    col = tl.load(Spans + 2 * slot)
    rank = tl.load(Spans + 2 * slot + 1)
    return first, end, col, rank


@triton.jit
def _shrink_kernel(
    X, A, Part, Rows, Starts, Slots, Spans,
    stride_xm, stride_am, stride_ps, stride_pm,
    n_in, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    first, end, col, rank = _segment_tile(Starts, Slots, Spans, BLOCK_M)
    if first >= end or rank == 0:     # a short segment's spare tile, or no weights for this projection
        return
    pos = first + tl.arange(0, BLOCK_M)
    m_mask = pos < end
    rows = tl.load(Rows + pos, mask=m_mask, other=0).to(tl.int64)
    split = tl.program_id(2)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = split * k_per_split
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + offs_r
        r_mask = r < rank
        a_rows = (col + r).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < n_in
            x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(A + a_rows[:, None] * stride_am + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(a))
        tl.store(Part + split * stride_ps + pos[:, None] * stride_pm + r[None, :], acc,
                 mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    Part, B, Y, Rows, Starts, Slots, Spans,
    stride_ps, stride_pm, stride_bn, stride_ym,
    n_out, num_splits,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
):
    first, end, col, rank = _segment_tile(Starts, Slots, Spans, BLOCK_M)
    if first >= end or rank == 0:     # a short segment's spare tile, or no weights for this projection
        return
    pos = first + tl.arange(0, BLOCK_M)
    m_mask = pos < end
    rows = tl.load(Rows + pos, mask=m_mask, other=0).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < n_out
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + offs_r
        r_mask = r < rank
        p_mask = m_mask[:, None] & r_mask[None, :]
        xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(0, num_splits):
            xa += tl.load(Part + s * stride_ps + pos[:, None] * stride_pm + r[None, :], mask=p_mask, other=0.0)
        b = tl.load(B + n[:, None].to(tl.int64) * stride_bn + (col + r)[None, :],
                    mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            acc += tl.dot(xa, tl.trans(b.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(xa.to(b.dtype), tl.trans(b))
    ptrs = Y + rows[:, None] * stride_ym + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + acc).to(Y.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Segments:
    """A step's adapter rows grouped per adapter: `rows` int32 `[n]` (token rows, each at most once),
    `starts` int32 `[count + 1]` (segment s is `rows[starts[s]:starts[s + 1]]`; may be empty), `slots`
    int32 `[count]` (its adapter's slot in the stacked weights), all on the kernels' device, and
    `max_len`, the longest segment, on the host: it sizes the grids without reading the device."""

    rows: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor
    max_len: int

    @property
    def count(self) -> int:
        return self.slots.shape[0]

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor, device: torch.device | str) -> Segments:
        """From each token's adapter slot (a CPU int tensor `[T]`, -1: the base model): segments in slot
        order, each segment's rows ascending. One host-to-device copy."""
        check(token_slots.device.type == "cpu" and token_slots.dim() == 1, "token_slots must be a 1-D CPU tensor")
        order = torch.argsort(token_slots, stable=True)
        ordered = token_slots[order]
        keep = ordered >= 0
        slots, counts = torch.unique_consecutive(ordered[keep], return_counts=True)
        starts = torch.zeros(slots.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=starts[1:])
        meta = torch.cat([order[keep], starts, slots]).to(torch.int32).to(device)
        n, s = int(keep.sum()), slots.numel()
        return cls(meta[:n], meta[n:n + s + 1], meta[n + s + 1:], int(counts.max()) if s else 0)


def _check_segments(segs: Segments, device: torch.device) -> None:
    for name, t in (("rows", segs.rows), ("starts", segs.starts), ("slots", segs.slots)):
        check_tensor(f"segments.{name}", t, 1, (torch.int32,), device)
        check(t.is_contiguous(), f"segments.{name} must be contiguous")
    check(segs.starts.shape[0] == segs.count + 1, f"segments.starts must have {segs.count + 1} entries, "
          f"got {segs.starts.shape[0]}")


def _check_spans(spans: torch.Tensor, max_rank: int, stacked: int, device: torch.device) -> None:
    check_tensor("spans", spans, 2, (torch.int32,), device)
    check(spans.shape[1] == 2 and spans.is_contiguous(), f"spans must be a contiguous [slots, 2], got {tuple(spans.shape)}")
    check(0 < max_rank <= stacked, f"max_rank {max_rank} must be in 1..{stacked} (the stacked columns)")


def _block_m(max_len: int) -> int:
    """Rows per tile: 16 (the smallest `tl.dot`) for decode-sized segments, 64 for prefill-sized ones."""
    return 16 if max_len <= 16 else 64


def num_warps(block_m: int) -> int:
    """8 warps for 64-row tiles: with 4, the fp32 shrink spills registers on sm_90 (sm90_compile.py)."""
    return 4 if block_m == 16 else 8


def _block_r(max_rank: int) -> int:
    return max(16, min(MAX_BLOCK_R, next_pow2(max_rank)))


def split_k(programs: int, n_in: int) -> int:
    """Splits of the input dimension: doubled while the grid is short of TARGET_PROGRAMS and each split
    keeps at least one BLOCK_K step. A power of two, so few distinct values reach the kernel."""
    split, steps = 1, triton.cdiv(n_in, BLOCK_K)
    while programs * split < TARGET_PROGRAMS and split * 2 <= min(steps, MAX_SPLIT):
        split *= 2
    return split


def lora_shrink(x: torch.Tensor, a: torch.Tensor, spans: torch.Tensor, max_rank: int, segs: Segments,
                *, split: int | None = None) -> torch.Tensor:
    """Each segment's rows of `x [T, in]` times its adapter's columns of `a [S, in]`, transposed.

    `spans [slots, 2]` int32: each slot's first column in `a` and its rank; `max_rank`: the largest rank.
    Returns fp32 partial sums `[split, n, max_rank]` (n = `segs.rows` entries): summed over dim 0, row p
    is `x[rows[p]] @ a[start:start + rank].T` of p's segment; columns past that rank are not written.
    """
    check_tensor("x", x, 2)
    check_tensor("a", a, 2, (x.dtype,), x.device)
    check(a.shape[1] == x.shape[1], f"a {tuple(a.shape)} must have x's {x.shape[1]} input columns")
    _check_spans(spans, max_rank, a.shape[0], x.device)
    _check_segments(segs, x.device)
    n_in = x.shape[1]
    block_m = _block_m(segs.max_len)
    m_tiles = triton.cdiv(segs.max_len, block_m)
    if split is None:
        split = split_k(segs.count * m_tiles, n_in)
    check(split >= 1, f"split must be positive, got {split}")
    part = torch.empty(split, segs.rows.shape[0], max_rank, dtype=torch.float32, device=x.device)
    if segs.count == 0 or segs.max_len == 0 or n_in == 0:
        return part.zero_()
    k_per_split = triton.cdiv(triton.cdiv(n_in, split), BLOCK_K) * BLOCK_K
    _shrink_kernel[(segs.count, m_tiles, split)](
        x, a, part, segs.rows, segs.starts, segs.slots, spans,
        x.stride(0), a.stride(0), part.stride(0), part.stride(1),
        n_in, k_per_split,
        BLOCK_M=block_m, BLOCK_R=_block_r(max_rank), BLOCK_K=BLOCK_K, UPCAST=upcast(x.dtype, x.device),
        num_warps=num_warps(block_m),
    )
    return part


def lora_expand(part: torch.Tensor, b: torch.Tensor, y: torch.Tensor, spans: torch.Tensor, segs: Segments) -> None:
    """`y[rows[p]] += (part[:, p].sum(0)) @ b[:, start:start + rank].T` for every row position p of a
    segment, in place; rows in no segment are untouched. `part`: `lora_shrink`'s result (or any fp32
    `[split, n, max_rank]`); `b [out, S]`, `y [T, out]` of one dtype."""
    check_tensor("y", y, 2)
    check_tensor("b", b, 2, (y.dtype,), y.device)
    check_tensor("part", part, 3, (torch.float32,), y.device)
    check(b.shape[0] == y.shape[1], f"b {tuple(b.shape)} must have y's {y.shape[1]} output rows")
    _check_spans(spans, part.shape[2], b.shape[1], y.device)
    _check_segments(segs, y.device)
    check(part.shape[1] == segs.rows.shape[0], f"part has {part.shape[1]} rows, the segments {segs.rows.shape[0]}")
    n_out = y.shape[1]
    if segs.count == 0 or segs.max_len == 0 or n_out == 0:
        return
    block_m = _block_m(segs.max_len)
    _expand_kernel[(segs.count, triton.cdiv(segs.max_len, block_m), triton.cdiv(n_out, BLOCK_N))](
        part, b, y, segs.rows, segs.starts, segs.slots, spans,
        part.stride(0), part.stride(1), b.stride(0), y.stride(0),
        n_out, part.shape[0],
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_R=_block_r(part.shape[2]), UPCAST=upcast(y.dtype, y.device),
        num_warps=num_warps(block_m),
    )


def add_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, spans: torch.Tensor,
             max_rank: int, segs: Segments) -> None:
    """`y[rows] += (x[rows] @ A_slot.T) @ B_slot.T` for each segment's rows and adapter slot: shrink,
    then expand. x `[T, in]`, y `[T, out]`, a `[S, in]`, b `[out, S]` (one dtype), any row strides."""
    lora_expand(lora_shrink(x, a, spans, max_rank, segs), b, y, spans, segs)
