"""A step's LoRA: which rows of the flattened tokens use which adapter, applied after each projection.

Each adapter's parts of a fused projection are one (A, B) pair (adapters.py `blocks`: q/k/v or
gate/up stacked, the scaling in B). How they are applied is chosen once per worker (`choose`: the
registry lays its `Stack` out for it) and followed per step in `build`:
- **triton** (the tensors are on CUDA): the Triton shrink and expand of kernels/lora.py over the
  stacked weights, the tokens grouped per adapter once per step: two launches per projection whatever
  the mix of adapters, each row multiplied by its own adapter only;
- **cpu** (on CPU with Tandem's CPU kernels loaded, kernels/cpu): `lora_` of kernels/cpu/lora.cpp
  over the stacked weights (B kept transposed, `Stack.cpu`): one call per projection whatever the
  mix, one adapter alone too; each row multiplied by its own adapter only, each part of a fused
  projection (q/k/v, gate/up) into its own outputs only, never by the zero blocks of the fused B;
- **torch** (the reference, and CPU without the kernels), per step either
  - *segmented* (few of the loaded adapters in the step): per adapter, gather its rows, two thin
    matmuls (`[n, in] @ [in, k*r]`, then `@ [k*r, out]`), add into their rows of the output, or
  - *stacked* (most of them): every loaded adapter's A and B side by side (registry.py `Stack`): one
    `x @ A_all.T` for all rows, each row's columns of other adapters zeroed by a mask, one
    `y += xa @ B_all.T`. Three ops per projection whatever the number of adapters, at the cost of
    multiplying by adapters a row does not use.
Base-model rows are untouched on every path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.lora.adapters import LoraAdapter

STACKED_SHARE = 0.5      # stacked once the step uses at least this share of the loaded adapters
CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what kernels/cpu's lora_ takes


def use_kernels(device: torch.device | str) -> bool:
    """The one choice between the Triton kernels and torch: the kernels wherever the tensors are on
    CUDA. On CPU they would run only under the Triton interpreter (correctness, not speed), so the
    torch paths serve there."""
    return torch.device(device).type == "cuda"


def choose(device: torch.device | str, dtype: torch.dtype, cpu_ops=None) -> str:
    """How a worker applies adapters: "triton" wherever the tensors are on CUDA (`use_kernels`); "cpu"
    on CPU where Tandem's CPU kernels are loaded (`cpu_ops`: kernels.cpu's module, None when they are
    off or did not build) and take the dtype; else "torch"."""
    if use_kernels(device):
        return "triton"
    if cpu_ops is not None and torch.device(device).type == "cpu" and dtype in CPU_DTYPES:
        return "cpu"
    return "torch"


class LoraBatch:
    def __init__(self, segments: list[tuple[LoraAdapter, torch.Tensor | None]], stack=None,
                 masks: list[torch.Tensor] | None = None, kernel_segments=None, cpu_slots: torch.Tensor | None = None):
        """`segments`: (adapter, its rows; None: every row of the step). `stack` (registry.py): apply
        all of them stacked, with `masks[layout id]` [rows, stacked rank] keeping each row's own
        columns, or, with `kernel_segments` (kernels/lora.py `Segments`), by the Triton kernels, or,
        with `cpu_slots` (int32 `[rows]`: each row's adapter in the stack, -1: none), by the CPU kernel."""
        self.segments = segments
        self.stack = stack
        self.masks = masks or []
        self.kernel_segments = kernel_segments
        self.cpu_slots = cpu_slots

    @staticmethod
    def build(adapters: Sequence[LoraAdapter | None], q_lens: Sequence[int], device, stack=None) -> LoraBatch | None:
        """The step's batch from each sequence's adapter (None: base model) and its token count; None
        when no sequence uses one. `stack`: the registry's stacked weights (None: segmented only)."""
        if all(a is None for a in adapters):
            return None
        if stack is not None and stack.cpu_ops is not None:
            return LoraBatch([], stack, cpu_slots=LoraBatch._token_slots(adapters, q_lens, stack, torch.int32))
        if stack is not None and use_kernels(device):
            return LoraBatch._for_kernels(adapters, q_lens, device, stack)
        rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
        owner: list[str | None] = []
        start = 0
        for adapter, n in zip(adapters, q_lens, strict=True):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + n))
            owner.extend([adapter.name if adapter is not None else None] * n)
            start += n
        segments = [(a, None if len(r) == start else torch.tensor(r, dtype=torch.int64, device=device))
                    for a, r in rows.values()]
        if stack is None or len(rows) < STACKED_SHARE * stack.count:
            return LoraBatch(segments)
        return LoraBatch(segments, stack, stack.masks(owner, device))

    @staticmethod
    def _token_slots(adapters: Sequence[LoraAdapter | None], q_lens: Sequence[int], stack, dtype) -> torch.Tensor:
        """Each token's adapter slot in the stack (-1: the base model), a CPU tensor `[tokens]`."""
        # Every adapter of a request in flight is loaded, so it is in the stack.
        slots = torch.tensor([stack.index[a.name] if a is not None else -1 for a in adapters], dtype=dtype)
        if all(n == 1 for n in q_lens):     # a decode step
            return slots
        return torch.repeat_interleave(slots, torch.tensor(list(q_lens), dtype=torch.int64))

    @staticmethod
    def _for_kernels(adapters: Sequence[LoraAdapter | None], q_lens: Sequence[int], device, stack) -> LoraBatch:
        from tandem.kernels.lora import Segments

        token_slots = LoraBatch._token_slots(adapters, q_lens, stack, torch.int64)
        return LoraBatch([], stack, kernel_segments=Segments.from_token_slots(token_slots, device))

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add every adapter's delta of projection `proj` of `layer` (input `x`, output `y`) into `y`."""
        if self.stack is not None:
            entry = self.stack.weights.get((layer, proj))
            if entry is None:
                return
            a, b, layout = entry
            if self.cpu_slots is not None:
                b_t, parts, first_part = self.stack.cpu[(layer, proj)]
                self.stack.cpu_ops.lora_(x, y, a, b_t, self.cpu_slots, parts, first_part)
                return
            if self.kernel_segments is not None:
                from tandem.kernels.lora import add_lora

                spans, max_rank = self.stack.spans[layout]
                add_lora(x, y, a, b, spans, max_rank, self.kernel_segments)
                return
            xa = x @ a.t()
            xa.mul_(self.masks[layout])
            y.addmm_(xa, b.t())
            return
        for adapter, rows in self.segments:
            block = adapter.blocks.get((layer, proj))
            if block is None:
                continue
            a, b = block
            if rows is None:
                y.addmm_(x @ a.t(), b.t())
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
