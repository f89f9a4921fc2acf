"""The CPU LoRA kernel (kernels/cpu/lora.cpp, `lora_`) on every ISA variant this CPU can run: against
its torch reference (kernels/reference.py `lora_parts`) for fp32, bf16 and fp16; adapters of different
ranks (below and above a micro-tile's columns), fused parts writing only their own outputs, an adapter
without weights for the projection, more rows of one adapter than one tile, widths that are not a
multiple of the vector; base rows untouched bit for bit; strided x and y; no rows, one row; any thread
count; bad input refused. Then the engine's LoRA batch on the kernel against its torch paths."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.lora.adapters import LoraAdapter
from tandem.engine.lora.batch import LoraBatch
from tandem.engine.lora.registry import Stack
from tandem.kernels import reference
from tests.kernels.helpers import TOL, assert_close

N_IN, N_OUT = 77, 150
# Per adapter, (rank, parts' (first output, outputs)): three parts (q/k/v-like), one part over every
# output, none (it does not adapt this projection), two parts not adjacent (q and v only), two parts.
ADAPTERS = [(8, [(0, 50), (50, 40), (90, 60)]), (5, [(0, N_OUT)]), (4, []), (3, [(0, 50), (100, 50)]),
            (16, [(3, 61), (64, 86)])]


def _table(adapters=ADAPTERS):
    """The stacked layout of `adapters`: parts [P, 4], first_part, stacked columns."""
    rows, first, col = [], [0], 0
    for rank, parts in adapters:
        rows += [(col + i * rank, rank, out, n) for i, (out, n) in enumerate(parts)]
        col += rank * len(parts)
        first.append(len(rows))
    return torch.tensor(rows, dtype=torch.int32).view(-1, 4), torch.tensor(first, dtype=torch.int32), col


def _weights(stacked: int, dtype, g):
    a = (torch.randn(stacked, N_IN, generator=g) * N_IN ** -0.5).to(dtype)
    return a, torch.randn(stacked, N_OUT, generator=g).to(dtype)


def _slots(tokens: int, g) -> torch.Tensor:
    """Every adapter and the base model (from 6 rows on), shuffled."""
    cycle = [0, 4, 1, -1, 3, 2]
    slots = torch.tensor([cycle[i % 6] for i in range(tokens)], dtype=torch.int32)[torch.randperm(tokens, generator=g)]
    if tokens > 40:
        slots[: tokens // 2] = 0        # 20+ rows of one adapter: more than one tile
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens", [1, 9, 70])
def test_lora_matches_the_reference_and_leaves_base_rows_alone(ops, dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    parts, first, stacked = _table()
    a, b_t = _weights(stacked, dtype, g)
    x = torch.randn(tokens, N_IN + 9, generator=g).to(dtype)[:, 4:4 + N_IN]     # a row stride of its own
    wide = torch.randn(tokens, N_OUT + 7, generator=g).to(dtype)
    y = wide[:, 2:2 + N_OUT]
    slots = _slots(tokens, g)
    before, want = wide.clone(), y.clone()
    reference.lora_parts(x, want, a, b_t, slots, parts, first)
    ops.lora_(x, y, a, b_t, slots, parts, first)
    assert_close(y, want, dtype)
    untouched = (slots == -1) | (slots == 2)            # base rows; adapter 2 has no weights here
    assert torch.equal(wide[untouched], before[untouched])
    assert torch.equal(wide[:, :2], before[:, :2]) and torch.equal(wide[:, 2 + N_OUT:], before[:, 2 + N_OUT:])
    q_only = slots == 3                                 # outputs 50-99 lie between its two parts
    assert torch.equal(y[q_only, 50:100], before[q_only, 52:102])
    changed = y.float() != before[:, 2:2 + N_OUT].float()
    assert changed[slots == 0].float().mean() > 0.9
    assert tokens < 2 or changed[slots == 4][:, 3:].float().mean() > 0.9


def test_lora_of_no_rows_one_row_and_no_parts(ops):
    g = torch.Generator().manual_seed(1)
    parts, first, stacked = _table()
    a, b_t = _weights(stacked, torch.float32, g)
    y = torch.zeros(0, N_OUT)
    ops.lora_(torch.zeros(0, N_IN), y, a, b_t, torch.zeros(0, dtype=torch.int32), parts, first)
    x, y = torch.randn(1, N_IN, generator=g), torch.randn(1, N_OUT, generator=g)
    base = y.clone()
    ops.lora_(x, y, a, b_t, torch.tensor([-1], dtype=torch.int32), parts, first)
    assert torch.equal(y, base)
    ops.lora_(x, y, a, b_t, torch.tensor([1], dtype=torch.int32), parts, first)
    torch.testing.assert_close(y, base + (x @ a[24:29].T) @ b_t[24:29], **TOL[torch.float32])
    none = torch.zeros(0, 4, dtype=torch.int32)                 # two adapters, neither adapts this projection
    ops.lora_(x, y, a, b_t, torch.tensor([1], dtype=torch.int32), none, torch.zeros(3, dtype=torch.int32))


def test_lora_is_the_same_on_any_thread_count(ops):
    """Each xa and each output is one sum computed by one task, whoever runs it."""
    g = torch.Generator().manual_seed(2)
    parts, first, stacked = _table()
    a, b_t = _weights(stacked, torch.float32, g)
    x, y = torch.randn(300, N_IN, generator=g), torch.randn(300, N_OUT, generator=g)
    slots = _slots(300, g)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            outs.append(y.clone())
            ops.lora_(x, outs[-1], a, b_t, slots, parts, first)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_lora_refuses_bad_input(ops):
    g = torch.Generator().manual_seed(3)
    parts, first, stacked = _table()
    a, b_t = _weights(stacked, torch.float32, g)
    x, y = torch.randn(4, N_IN, generator=g), torch.randn(4, N_OUT, generator=g)
    slots = torch.tensor([0, 1, -1, 4], dtype=torch.int32)

    def call(**kw):
        args = dict(x=x, y=y, a=a, b_t=b_t, slots=slots, parts=parts, first_part=first) | kw
        ops.lora_(**args)

    with pytest.raises(RuntimeError, match="slots\\[3\\] = 5"):
        call(slots=torch.tensor([0, 1, -1, 5], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="slots must be contiguous int32"):
        call(slots=slots.long())
    with pytest.raises(RuntimeError, match="outside the 150"):
        call(parts=parts + torch.tensor([0, 0, 1, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="stacked"):
        call(parts=parts + torch.tensor([stacked, 0, 0, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="write the same outputs"):
        overlapping = parts.clone()
        overlapping[1, 2] = 40
        call(parts=overlapping)
    with pytest.raises(RuntimeError, match="first_part"):
        call(first_part=first[:-1])
    with pytest.raises(RuntimeError, match="b_t must be contiguous"):
        call(b_t=b_t.t().contiguous().t())
    with pytest.raises(RuntimeError, match="share a dtype"):
        call(a=a.bfloat16())
    with pytest.raises(RuntimeError, match="unit stride"):
        call(x=torch.randn(N_IN, 4, generator=g).t())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        call(x=x.double(), y=y.double(), a=a.double(), b_t=b_t.double())


# ---- the engine's LoRA batch (engine/lora/batch.py) on the kernel -------------------------------------

def fused_adapter(name: str, rank: int, projections: dict[str, tuple[int, list[tuple[int, int]]]], g, dtype):
    """As adapters.py loads one: per fused projection one A [k*r, in] and one B [out, k*r] whose part i
    is non-zero only in its output rows."""
    blocks, parts = {}, {}
    for proj, (n_in, spans) in projections.items():
        n_out = 80 if proj == "qkv_proj" else 48
        a = (torch.randn(rank * len(spans), n_in, generator=g) * n_in ** -0.5).to(dtype)
        b = torch.zeros(n_out, rank * len(spans), dtype=dtype)
        for i, (out, n) in enumerate(spans):
            b[out:out + n, i * rank:(i + 1) * rank] = torch.randn(n, rank, generator=g).to(dtype)
        blocks[(0, proj)], parts[(0, proj)] = (a, b), tuple(spans)
    return LoraAdapter(name, "/nowhere", rank, 1.0, name * 8, blocks, parts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lora_batch_on_the_cpu_kernel_equals_its_torch_paths(ops, dtype):
    g = torch.Generator().manual_seed(4)
    qkv, o = (48, [(0, 48), (48, 16), (64, 16)]), (40, [(0, 48)])
    adapters = [fused_adapter("all4", 4, {"qkv_proj": qkv, "o_proj": o}, g, dtype),
                fused_adapter("qv12", 12, {"qkv_proj": (48, [(0, 48), (64, 16)])}, g, dtype),
                fused_adapter("o2", 2, {"o_proj": o}, g, dtype)]
    a1, a2, a3 = adapters
    seqs = [a2, None, a1, a3, a2, None, a1]          # prefill-sized and decode-sized sequences, interleaved
    q_lens = [5, 3, 1, 1, 9, 2, 1]
    tokens = sum(q_lens)
    kernel = Stack(adapters, ops)
    for proj, (n_in, n_out) in (("qkv_proj", (48, 80)), ("o_proj", (40, 48))):
        x = torch.randn(tokens, n_in, generator=g).to(dtype)
        y = torch.randn(tokens, n_out, generator=g).to(dtype)
        outs = {}
        for path, stack in (("segmented", None), ("stacked", Stack(adapters)), ("kernel", kernel)):
            batch = LoraBatch.build(seqs, q_lens, "cpu", stack)
            assert (batch.cpu_slots is not None, batch.stack is not None) == {
                "segmented": (False, False), "stacked": (False, True), "kernel": (True, True)}[path]
            outs[path] = y.clone()
            batch.apply(0, proj, x, outs[path])
        for path in ("segmented", "stacked"):
            assert_close(outs["kernel"], outs[path], dtype)
        # rows 5-7 and 19-20 are the base model's; row 9 (o2) has no qkv_proj, rows 0-4 and 10-18 (qv12)
        # no o_proj, and qv12 leaves the k outputs (48-63) of its rows alone
        base = [5, 6, 7, 19, 20] + ([9] if proj == "qkv_proj" else [*range(5), *range(10, 19)])
        assert torch.equal(outs["kernel"][base], y[base])
        if proj == "qkv_proj":
            qv = [*range(5), *range(10, 19)]
            assert torch.equal(outs["kernel"][qv, 48:64], y[qv, 48:64])
        before = outs["kernel"].clone()
        batch.apply(1, proj, x, outs["kernel"])                           # no adapter has layer 1
        assert torch.equal(outs["kernel"], before)
    one = Stack([a1], ops)                              # one adapter alone runs on the kernel too
    batch = LoraBatch.build([a1, None], [3, 1], "cpu", one)
    x, y = torch.randn(4, 40, generator=g).to(dtype), torch.randn(4, 48, generator=g).to(dtype)
    got, want = y.clone(), y.clone()
    batch.apply(0, "o_proj", x, got)
    LoraBatch.build([a1, None], [3, 1], "cpu", None).apply(0, "o_proj", x, want)
    assert_close(got, want, dtype)
    assert torch.equal(got[3], y[3])
    assert LoraBatch.build([None, None], [3, 1], "cpu", kernel) is None
