"""Mixed-adapter LoRA kernels (kernels/lora.py): shrink and expand against the torch reference for
fp32, fp16 and bf16 storage; adapters of different ranks (one above a rank tile, one that does not
adapt the projection), base-model rows left alone bit for bit, empty segments, gathered rows of
strided activations, split-K; and the engine's LoRA batch on the kernels against its torch paths."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.lora import batch as lora_batch
from tandem.engine.lora.adapters import LoraAdapter
from tandem.engine.lora.batch import LoraBatch
from tandem.engine.lora.registry import Stack
from tandem.kernels import reference
from tandem.kernels.lora import Segments, add_lora, lora_expand, lora_shrink, split_k
from tests.kernels.helpers import DEVICE, DTYPES, TOL, assert_close, randn


def stacked(ranks: list[int], n_in: int, n_out: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adapters of `ranks` side by side (rank 0: no weights for this projection): a, b and their spans."""
    total = sum(ranks)
    a = randn(total, n_in, dtype=dtype, gen=gen) * n_in ** -0.5
    b = randn(n_out, total, dtype=dtype, gen=gen) * 0.5
    starts = [sum(ranks[:i]) for i in range(len(ranks))]
    spans = torch.tensor(list(zip(starts, ranks, strict=True)), dtype=torch.int32, device=DEVICE)
    return a, b, spans


def segments(groups: list[tuple[int, list[int]]]) -> Segments:
    """Explicit segments (slot, rows), empty ones allowed, in the given order."""
    rows = [r for _, g in groups for r in g]
    starts = [0]
    for _, g in groups:
        starts.append(starts[-1] + len(g))
    as_int = dict(dtype=torch.int32, device=DEVICE)
    return Segments(torch.tensor(rows, **as_int), torch.tensor(starts, **as_int),
                    torch.tensor([s for s, _ in groups], **as_int), max((len(g) for _, g in groups), default=0))


# Slot 1 adapts nothing here; slot 2's rank spans two rank tiles; rows 3, 9 and 21 are the base model's;
# segment 3 is empty; rows are interleaved between adapters and out of order within a segment.
RANKS = [8, 0, 80, 4, 16]
GROUPS = [(2, [0, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 22, 23]), (0, [4, 1]),
          (1, [2]), (3, []), (4, [24, 25])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_lora_matches_the_reference_and_leaves_base_rows_alone(dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, n_in, n_out = 27, 72, 100                 # neither a multiple of a tile
    a, b, spans = stacked(RANKS, n_in, n_out, dtype, gen)
    wide = randn(tokens, n_in + 9, dtype=dtype, gen=gen)
    x = wide[:, 5:5 + n_in]                          # a row stride other than n_in
    y = randn(tokens, n_out, dtype=dtype, gen=gen)
    segs = segments(GROUPS)
    expected = y.clone()
    reference.lora(x, expected, a, b, spans, segs.rows, segs.starts, segs.slots)
    out_wide = torch.zeros(tokens, n_out + 3, dtype=dtype, device=DEVICE)
    out = out_wide[:, :n_out]
    out.copy_(y)
    add_lora(x, out, a, b, spans, max(RANKS), segs)
    assert_close(out, expected, dtype)
    base = [r for r in range(tokens) if r not in segs.rows.tolist()] + [2]   # slot 1 has no weights
    assert torch.equal(out[base], y[base])
    assert not out_wide[:, n_out:].any()
    assert (out.float() - y.float()).abs()[[0, 4, 24]].amax() > 0.1      # the adapters did change rows


@pytest.mark.parametrize("split", [1, 3, None])
def test_shrink_partials_sum_to_x_times_a(split):
    gen = torch.Generator().manual_seed(1)
    x = randn(27, 200, dtype=torch.float32, gen=gen)
    a, _, spans = stacked(RANKS, 200, 8, torch.float32, gen)
    segs = segments(GROUPS)
    part = lora_shrink(x, a, spans, max(RANKS), segs, split=split)
    assert part.dtype == torch.float32 and part.shape[1:] == (segs.rows.shape[0], max(RANKS))
    if split is not None:
        assert part.shape[0] == split
    else:
        assert part.shape[0] == split_k(5 * 2, 200) == 4      # 10 programs: as many splits as 4 K steps allow
    xa = reference.lora(x, torch.zeros(27, 8, device=DEVICE), a, b_zero(spans), spans,
                        segs.rows, segs.starts, segs.slots)
    total = part.sum(0)
    starts = segs.starts.tolist()
    for s, slot in enumerate(segs.slots.tolist()):
        lo, hi, rank = starts[s], starts[s + 1], RANKS[slot]
        torch.testing.assert_close(total[lo:hi, :rank].cpu(), xa[lo:hi, :rank].cpu(), **TOL[torch.float32])


def b_zero(spans: torch.Tensor) -> torch.Tensor:
    return torch.zeros(8, int(spans[:, 1].sum()), device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_expand_of_given_partials_and_prefill_sized_segments(dtype):
    """Two segments of 70 rows (two 64-row tiles each) and split partials that expand must add up."""
    gen = torch.Generator().manual_seed(2)
    tokens, n_out = 150, 130
    rows = torch.randperm(tokens, generator=gen)
    segs = segments([(1, rows[:70].tolist()), (0, rows[70:140].tolist())])
    _, b, spans = stacked([16, 32], 8, n_out, dtype, gen)
    part = torch.randn(2, 140, 32, generator=gen).to(DEVICE)
    for s, (lo, hi) in enumerate(((0, 70), (70, 140))):
        part[:, lo:hi, [32, 16][s]:] = float("nan")             # past a segment's rank: never read
    y = randn(tokens, n_out, dtype=dtype, gen=gen)
    out = y.clone()
    lora_expand(part, b, out, spans, segs)
    expected = y.float().clone()
    for slot, lo, hi in ((1, 0, 70), (0, 70, 140)):
        col, rank = spans[slot].tolist()
        idx = segs.rows[lo:hi].long()
        expected[idx] += part[:, lo:hi, :rank].sum(0) @ b[:, col:col + rank].float().T
    assert_close(out, expected.to(dtype), dtype)
    untouched = rows[140:].to(DEVICE)
    assert torch.equal(out[untouched], y[untouched])


def test_segments_from_token_slots_group_rows_per_adapter_in_order():
    segs = Segments.from_token_slots(torch.tensor([2, -1, 0, 2, 2, -1, 0, 5]), DEVICE)
    assert segs.slots.tolist() == [0, 2, 5] and segs.starts.tolist() == [0, 2, 5, 6]
    assert segs.rows.tolist() == [2, 6, 0, 3, 4, 7] and segs.max_len == 3
    assert segs.rows.dtype == torch.int32 and segs.rows.device.type == DEVICE.type
    none = Segments.from_token_slots(torch.tensor([-1, -1]), DEVICE)
    assert none.count == 0 and none.max_len == 0 and none.starts.tolist() == [0]
    y = torch.ones(2, 16, device=DEVICE)
    add_lora(torch.ones(2, 16, device=DEVICE), y, *stacked([4], 16, 16, torch.float32, torch.Generator())[:3], 4, none)
    assert torch.equal(y, torch.ones(2, 16, device=DEVICE))


def test_wrappers_refuse_what_the_kernels_cannot_read():
    gen = torch.Generator().manual_seed(3)
    x = randn(4, 16, dtype=torch.float32, gen=gen)
    a, b, spans = stacked([4, 8], 16, 16, torch.float32, gen)
    segs = segments([(0, [0, 1]), (1, [3])])
    with pytest.raises(ValueError, match="a dtype"):
        lora_shrink(x, a.half(), spans, 8, segs)
    with pytest.raises(ValueError, match="input columns"):
        lora_shrink(x, a[:, :8], spans, 8, segs)
    with pytest.raises(ValueError, match="spans dtype"):
        lora_shrink(x, a, spans.long(), 8, segs)
    with pytest.raises(ValueError, match="max_rank 13"):
        lora_shrink(x, a, spans, 13, segs)
    with pytest.raises(ValueError, match="starts must have"):
        lora_shrink(x, a, spans, 8, Segments(segs.rows, segs.starts[:2], segs.slots, 2))
    with pytest.raises(ValueError, match="output rows"):
        add_lora(x, torch.zeros(4, 12, device=DEVICE), a, b, spans, 8, segs)


# ---- the engine's LoRA batch (engine/lora/batch.py) on the kernels ----------------------------------------

def adapter(name: str, rank: int, projections: dict[str, tuple[int, int]], gen, dtype) -> LoraAdapter:
    blocks = {(0, p): (randn(rank, n_in, dtype=dtype, gen=gen) * n_in ** -0.5, randn(n_out, rank, dtype=dtype, gen=gen))
              for p, (n_in, n_out) in projections.items()}
    return LoraAdapter(name, "/nowhere", rank, 1.0, name * 8, blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lora_batch_on_the_kernels_equals_its_torch_paths(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(4)
    qkv, o = (48, 80), (40, 48)
    adapters = [adapter("all4", 4, {"qkv_proj": qkv, "o_proj": o}, gen, dtype),
                adapter("qkv12", 12, {"qkv_proj": qkv}, gen, dtype),
                adapter("o2", 2, {"o_proj": o}, gen, dtype)]
    stack = Stack(adapters)
    a1, a2, a3 = adapters
    seqs = [a2, None, a1, a3, a2, None, a1]          # prefill-sized and decode-sized sequences, interleaved
    q_lens = [5, 3, 1, 1, 9, 2, 1]
    tokens = sum(q_lens)
    for proj, (n_in, n_out) in (("qkv_proj", qkv), ("o_proj", o)):
        x = randn(tokens, n_in, dtype=dtype, gen=gen)
        y = randn(tokens, n_out, dtype=dtype, gen=gen)
        outs = {}
        for path in ("segmented", "stacked", "kernels"):
            monkeypatch.setattr(lora_batch, "use_kernels", lambda device, path=path: path == "kernels")
            batch = LoraBatch.build(seqs, q_lens, DEVICE, None if path == "segmented" else stack)
            assert (batch.kernel_segments is not None, batch.stack is not None) == {
                "segmented": (False, False), "stacked": (False, True), "kernels": (True, True)}[path]
            outs[path] = y.clone()
            batch.apply(0, proj, x, outs[path])
        for path in ("segmented", "stacked"):
            assert_close(outs["kernels"], outs[path], dtype)
        # rows 5-7 and 19-20 are the base model's; row 9 (o2) has no qkv_proj, rows 0-4 and 10-18 (qkv12) no o_proj
        base = [5, 6, 7, 19, 20] + ([9] if proj == "qkv_proj" else [*range(5), *range(10, 19)])
        assert torch.equal(outs["kernels"][base], y[base])
        assert not torch.equal(outs["kernels"], y)
        before = outs["kernels"].clone()
        batch.apply(1, proj, x, outs["kernels"])                          # no adapter has layer 1
        assert torch.equal(outs["kernels"], before)
    monkeypatch.setattr(lora_batch, "use_kernels", lambda device: True)
    assert LoraBatch.build([None, None], [3, 1], DEVICE, stack) is None
