"""Decode steps from captured graphs: one hook in the model runner, two implementations.

`GraphRunner.forward(ctx)` returns the logits of a pure decode step from a graph captured for a
fixed batch size, or None when no graph fits (prefill, mixed and larger batches: the runner then
runs the model eagerly). A batch of `b` sequences runs the smallest captured size `>= b`; the
padding rows are harmless: they never write the KV pool, their results are dropped, and no real
row reads them (every op of the forward is row-wise except attention, which sees only real rows).

- **CUDA** (`CudaGraphRunner`): CUDA graphs over the whole forward, attention included (the triton
  backend reads its metadata from static buffers; padding rows get KV slot -1, which the store
  kernel skips, and KV length 0, which attends to nothing). Unchecked on real hardware so far: the
  project's CI has no GPU.
- **CPU** (`InductorGraphRunner`): `torch.compile` (inductor) of the whole forward as one graph per
  size, attention left opaque as the custom op `tandem::attention` (its page tables and per-length
  buckets are data-dependent; it runs the real backend on the real rows of the step being run).
  Compiled artefacts go to inductor's on-disk cache (`$TORCHINDUCTOR_CACHE_DIR`, else
  `<tandem cache>/inductor`), so a second start only re-traces. Off by default: on the project's
  2-core CPU it measured within 7% of eager (docs/benchmarks.md).

`create_graph_runner` decides from the config whether there is one, and captures it (with a
progress line per size).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.engine.config import EngineConfig
from tandem.engine.forward_context import ForwardContext
from tandem.engine.hardware import choose_graphs, detect

log = logging.getLogger(__name__)

# Default captured sizes (SGLang's list on CUDA). Capture is cheap there; on CPU every size is a
# compile (SmolLM2: ~17 s cold on one quiet core, ~2 s warm from the cache), so the list is short.
CUDA_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, *range(32, 257, 8))
CPU_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32)
CUDA_DEFAULT_MAX_BS = 256
CPU_DEFAULT_MAX_BS = 32
def graph_enabled(cfg: EngineConfig, device: torch.device) -> bool:
    """`enable_graph`, or for None the device's default (engine/hardware.py: on where it measured
    faster than eager, docs/benchmarks.md)."""
    if cfg.enable_graph is not None:
        return cfg.enable_graph
    return bool(choose_graphs(device.type).value)


def capture_sizes(cfg: EngineConfig, device: torch.device) -> list[int]:
    """The batch sizes to capture, never above `max_running_requests` (no bigger batch runs):
    `graph_bs` up to `graph_max_bs` if given; else the device's list up to `graph_max_bs` (default:
    the device's cap), which is itself captured."""
    cuda = device.type == "cuda"
    max_bs = cfg.graph_max_bs
    if cfg.graph_bs is not None:
        cap = min(max_bs or cfg.max_running_requests, cfg.max_running_requests)
        return sorted({b for b in cfg.graph_bs if b <= cap})
    if max_bs is None:
        max_bs = CUDA_DEFAULT_MAX_BS if cuda else CPU_DEFAULT_MAX_BS
    max_bs = min(max_bs, cfg.max_running_requests)
    sizes = {b for b in (CUDA_BATCH_SIZES if cuda else CPU_BATCH_SIZES) if b <= max_bs}
    return sorted(sizes | {max_bs})


def create_graph_runner(cfg: EngineConfig, model: torch.nn.Module, attn, device: torch.device,
                        context_len: int, vocab_size: int) -> GraphRunner | None:
    """A captured graph runner, or None when graphs are off (or the backend cannot be captured)."""
    if not graph_enabled(cfg, device):
        return None
    sizes = capture_sizes(cfg, device)
    if not sizes:
        log.warning("decode graphs: no batch size to capture (--graph-bs %s, --graph-max-bs %s); running eager",
                    cfg.graph_bs, cfg.graph_max_bs)
        return None
    if device.type == "cuda":
        if not attn.supports_cuda_graph:
            log.warning("decode graphs: CUDA graphs need the triton attention backend, not %r; running eager",
                        attn.name)
            return None
        runner: GraphRunner = CudaGraphRunner(model, attn, sizes, device, context_len, vocab_size)
    else:
        runner = InductorGraphRunner(model, attn, sizes, device)
    runner.capture()
    return runner


class GraphRunner(ABC):
    """Decode forwards from graphs captured for `sizes`; see the module docstring."""

    kind = ""

    def __init__(self, model: torch.nn.Module, attn, sizes: list[int], device: torch.device):
        self.model = model
        self.attn = attn
        self.sizes = sorted(sizes)
        self.max_bs = self.sizes[-1]
        self.device = device
        self.capture_s = 0.0
        self.replays = 0          # decode steps run from a graph
        self.eager_decodes = 0    # decode steps too large for every graph (run eagerly)

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured size that holds `batch_size` rows, or None."""
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) else None

    def can_run(self, ctx: ForwardContext) -> bool:
        return ctx.is_decode and ctx.num_tokens == ctx.batch_size <= self.max_bs

    def capture(self) -> None:
        """Capture every size (largest first: CUDA graphs then share one memory pool), one progress
        line per size."""
        t0 = time.perf_counter()
        done: list[int] = []
        order = sorted(self.sizes, reverse=True)
        log.info("capturing decode graphs (%s): %d sizes, bs %s", self.kind, len(order),
                 "/".join(map(str, self.sizes)))
        with torch.inference_mode():
            for bs in order:
                self._capture(bs)
                done.append(bs)
                log.info("capturing decode graphs: bs %s (%d/%d) %.1f s", "/".join(map(str, sorted(done))),
                         len(done), len(order), time.perf_counter() - t0)
        self.capture_s = time.perf_counter() - t0

    def forward(self, ctx: ForwardContext) -> torch.Tensor | None:
        """fp32 logits `[len(ctx.logits_indices), vocab]` from a graph, or None if none fits."""
        if not self.can_run(ctx):
            self.eager_decodes += ctx.is_decode
            return None
        size = self.padded_size(ctx.batch_size)
        logits = self._replay(ctx, size)                        # [size, vocab], padding rows last
        self.replays += 1
        # Decode rows all sample, in order: the first `batch_size` rows are the answer.
        return logits.index_select(0, ctx.logits_indices)

    @abstractmethod
    def _capture(self, size: int) -> None:
        ...

    @abstractmethod
    def _replay(self, ctx: ForwardContext, size: int) -> torch.Tensor:
        ...


# --- CPU: inductor, attention as an opaque custom op ---------------------------------------------

_step = threading.local()   # .ctx: the ForwardContext of the step a compiled graph is running


@torch.library.custom_op("tandem::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The attention backend on the real rows of the running step (`_step.ctx`); padding rows (past
    its tokens) get zeros and are never written to the pool. Writes the pool as a side effect, like
    the backend does in an eager forward (the graph never reads the pool itself)."""
    ctx: ForwardContext | None = getattr(_step, "ctx", None)
    if ctx is None:
        raise RuntimeError("tandem::attention runs only inside InductorGraphRunner.forward")
    n = ctx.num_tokens
    if n == q.shape[0]:
        return ctx.attn.forward(layer, q, k, v, ctx)
    out = q.new_zeros(q.shape)
    if n:
        out[:n] = ctx.attn.forward(layer, q[:n], k[:n], v[:n], ctx)
    return out


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


class _OpaqueAttention:
    """Stands in for `ctx.attn` inside the compiled graph: one opaque op per layer."""

    name = "graph"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        return torch.ops.tandem.attention(q, k, v, layer)


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled graphs: $TORCHINDUCTOR_CACHE_DIR if set (to anything but
    inductor's own default, /tmp/torchinductor_$USER, which inductor writes into the environment the
    first time anything in the process asks for it), else `<tandem cache dir>/inductor/<ISA level>`
    ($TANDEM_CACHE_DIR, else ~/.cache/tandem): kept across reboots, next to the imported models.

    Per ISA level (engine/hardware.py): graphs compiled on one CPU class, or under the AVX2
    emulation's caps, are never loaded under another (a cache shared by the two returned garbage
    logits under the emulation)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir as inductor_default

    from tandem.engine.models.source import default_cache_dir

    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env and os.path.abspath(env) != os.path.abspath(inductor_default()):
        return env
    return str(default_cache_dir() / "inductor" / detect("cpu").isa)


# emulate_precision_casts: a fused kernel rounds to bf16 where eager does, so compiled and eager
# agree (without it, fp32 intermediates kept inside fused kernels moved SmolLM2's logits by up to 7.5).
# No freezing: it folded and prepacked the weights for oneDNN (a copy per graph) and measured no
# faster here, and it turns off AOTAutograd's cache (a warm start re-traced for 7 s per size, not 1.6 s).
INDUCTOR_OPTIONS = {"emulate_precision_casts": True, "fx_graph_cache": True}


class InductorGraphRunner(GraphRunner):
    kind = "inductor"

    def __init__(self, model: torch.nn.Module, attn, sizes: list[int], device: torch.device):
        super().__init__(model, attn, sizes, device)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()   # inductor reads it at every lookup
        # One compiled graph per size, all of the model class's `forward` (dynamo counts them per
        # code object, across every runner of the process): room for this runner's; never dynamic.
        torch._dynamo.config.recompile_limit += len(sizes)
        self._compiled = torch.compile(model, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
        self._shim = _OpaqueAttention()
        self._rows = {s: torch.arange(s, device=device) for s in self.sizes}

    def _graph_ctx(self, ctx: ForwardContext, size: int) -> ForwardContext:
        pad = size - ctx.num_tokens
        return dataclasses.replace(
            ctx, input_ids=F.pad(ctx.input_ids, (0, pad)), positions=F.pad(ctx.positions, (0, pad)),
            logits_indices=self._rows[size], attn=self._shim, attn_metadata=None)

    def _capture(self, size: int) -> None:
        # The first call compiles. No real rows: attention returns zeros and touches no page.
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        ctx = ForwardContext(input_ids=empty, positions=empty, out_slots=empty, logits_indices=empty,
                             page_table=torch.zeros(0, 1, dtype=torch.int32, device=self.device), q_lens=[],
                             prefix_lens=[], kv_lens=[], is_decode=True, attn=self.attn)
        self._run(ctx, size)

    def _run(self, ctx: ForwardContext, size: int) -> torch.Tensor:
        _step.ctx = ctx
        try:
            return self._compiled(self._graph_ctx(ctx, size))
        finally:
            _step.ctx = None

    def _replay(self, ctx: ForwardContext, size: int) -> torch.Tensor:
        return self._run(ctx, size)


# --- CUDA: CUDA graphs over the whole forward ----------------------------------------------------

class CudaGraphRunner(GraphRunner):
    """Static input buffers sized for the largest batch, shared by every graph (SGLang's layout):
    a replay copies the step's tokens, positions, slots, page table and KV lengths into them."""

    kind = "cuda-graph"

    def __init__(self, model: torch.nn.Module, attn, sizes: list[int], device: torch.device,
                 context_len: int, vocab_size: int):
        super().__init__(model, attn, sizes, device)
        n = self.max_bs
        page_size = attn.pool.spec.page_size
        self.max_kv_len = context_len
        self.max_pages = -(-context_len // page_size)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(n, self.max_pages, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, device=device)
        self.logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[int, Callable[[], None]] = {}   # size -> replay
        self.pool = None
        self._keep: list = []

    def _static_ctx(self, size: int) -> ForwardContext:
        ctx = ForwardContext(
            input_ids=self.input_ids[:size], positions=self.positions[:size], out_slots=self.out_slots[:size],
            logits_indices=self.rows[:size], page_table=self.page_table[:size], q_lens=[1] * size,
            prefix_lens=[0] * size, kv_lens=[1] * size, is_decode=True, attn=self.attn)
        ctx.attn_metadata = self.attn.graph_metadata(ctx, self.kv_lens[:size], self.max_kv_len)
        return ctx

    def _capture(self, size: int) -> None:
        ctx = self._static_ctx(size)   # every row is padding now: slot -1, KV length 0

        def step() -> None:
            self.logits[:size].copy_(self.model(ctx))

        self.graphs[size] = self._record(step)

    def _record(self, step: Callable[[], None]) -> Callable[[], None]:
        """Warm `step` up on a side stream (the triton kernels compile outside the capture), capture
        it into a CUDA graph in the shared pool; returns the graph's replay."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                step()
            torch.cuda.synchronize()
        self._keep.append(graph)
        return graph.replay

    def can_run(self, ctx: ForwardContext) -> bool:
        return super().can_run(ctx) and ctx.page_table.shape[1] <= self.max_pages and max(ctx.kv_lens) <= self.max_kv_len

    def _replay(self, ctx: ForwardContext, size: int) -> torch.Tensor:
        b, pages = ctx.batch_size, ctx.page_table.shape[1]
        self.input_ids[:b].copy_(ctx.input_ids)
        self.positions[:b].copy_(ctx.positions)
        self.out_slots[:b].copy_(ctx.out_slots)
        self.page_table[:b, :pages].copy_(ctx.page_table)
        self.kv_lens[:b].copy_(torch.tensor(ctx.kv_lens, dtype=torch.int32))
        if size > b:                    # padding rows: token 0 at position 0, no KV slot, nothing to attend
            self.input_ids[b:size].zero_()
            self.positions[b:size].zero_()
            self.out_slots[b:size].fill_(-1)
            self.kv_lens[b:size].zero_()
        self.graphs[size]()
        return self.logits[:size]
