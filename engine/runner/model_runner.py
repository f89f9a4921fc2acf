"""Owns the model, the KV pool, the attention backend and the sampler; turns a StepBatch into tokens.

This is the only place in the engine that builds tensors from scheduler bookkeeping.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tandem.engine.attention.base import create_backend
from tandem.engine.config import EngineConfig
from tandem.engine.errors import InvalidRequest
from tandem.engine.forward_context import ForwardContext
from tandem.engine.hardware import (
    Choice,
    choose_cpu_kernels,
    choose_extend_attention,
    choose_kv_layout,
    choose_weight_prepack,
    detect,
)
from tandem.engine.hardware import resolve_dtype as choose_dtype
from tandem.engine.kvcache.kv_pool import KVPool, KVPoolSpec
from tandem.engine.lora.batch import LoraBatch
from tandem.engine.models.config import ModelConfig
from tandem.engine.models.layers import use_cpu_kernels
from tandem.engine.models.registry import model_class
from tandem.engine.models.weights import iter_weights
from tandem.engine.runner.grammar_mask import MaskJob
from tandem.engine.runner.graph_runner import create_graph_runner, graph_enabled
from tandem.engine.runner.sampler import Sampler, SamplingBatch
from tandem.engine.runner.verify import VerifyRow, verify
from tandem.engine.scheduler.batch import SampledToken, SeqStep, StepBatch
from tandem.engine.scheduler.future import FutureSlots

log = logging.getLogger(__name__)

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`--dtype`, or for `auto` what this device computes fast (engine/hardware.py)."""
    return choose_dtype(name, detect(device), model_cfg.torch_dtype).value


@dataclass
class StepTimings:
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    mask_wait_s: float = 0.0    # how long sampling waited for the grammar masks after the forward pass


@dataclass
class PreparedStep:
    """A step's device inputs, built on the scheduling thread; `execute` may run it on another."""

    batch: StepBatch
    ctx: ForwardContext
    sampling: list[SeqStep]
    sampling_batch: SamplingBatch | None
    futures: torch.Tensor | None       # future-map slot of each sampled token
    has_future_inputs: bool
    prepare_s: float
    # Structured output: the grammar masks of the sampled rows, filled beside the forward pass
    # (engine/runner/grammar_mask.py); None when no row is constrained.
    masks: MaskJob | None = None


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, context_len: int,
                 kv_allocator: Callable[[KVPoolSpec], torch.Tensor] | None = None):
        """`kv_allocator`, if given, provides the KV pool's storage (a transfer backend's shared memory)."""
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = resolve_device(cfg.device)
        self.hardware = detect(self.device)
        # The hardware-dependent defaults this runner took, and why (logged; the worker's banner shows them).
        self.choices: dict[str, Choice] = {"dtype": choose_dtype(cfg.dtype, self.hardware, model_cfg.torch_dtype)}
        self.dtype = self.choices["dtype"].value
        self.choices["KV layout"] = choose_kv_layout(cfg.kv_layout, self.hardware)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.cpu_ops = self._cpu_kernels()   # before the model: fp32 weights are packed for their linear kernel
        self.model = self._load_model(context_len)
        spec = self._pool_spec()
        self.pool = KVPool(spec, self.device, kv_allocator(spec) if kv_allocator else None)
        self.attn = create_backend(cfg.attention_backend, self.pool, model_cfg.num_heads, model_cfg.head_dim)
        if self.cpu_ops is not None:
            use_cpu_kernels(self.model, self.cpu_ops)
            if hasattr(self.attn, "cpu_ops"):
                self.attn.cpu_ops = self.cpu_ops
        if hasattr(self.attn, "extend_attention") and self.hardware.is_cpu:
            self.choices["extend attention"] = choose_extend_attention(self.hardware, self.dtype)
            self.attn.extend_attention = self.choices["extend attention"].value
        self.sampler = Sampler()
        # Decode steps from captured graphs (None: always eager); captures them now.
        self.graphs = create_graph_runner(cfg, self.model, self.attn, self.device, context_len, model_cfg.vocab_size)
        self._generators: dict[str, torch.Generator] = {}
        self._masks: ThreadPoolExecutor | None = None   # grammar masks beside a synchronous forward pass
        # batch -> its forward pass's ForwardContext.after_layer, or None (a prefill worker's KV streaming)
        self.layer_hook: Callable[[StepBatch], Callable[[int], None] | None] | None = None
        self.lora_stack = None   # engine.lora.registry.Stack, set by the engine when adapters are loaded
        # Sampled tokens by future slot (engine/scheduler/future.py): written after each step's
        # sampling, read by the next step's inputs when overlap scheduling planned it early.
        self.future_map = torch.zeros(FutureSlots(cfg.max_running_requests).size, dtype=torch.int64,
                                      device=self.device)
        self.last_timings = StepTimings()
        self.last_batch: StepBatch | None = None   # the batch of the latest run() (step metrics read it)
        # (start, end) perf_counter of recent forward passes: the gaps between them are the time
        # the model waited for the CPU (bench/overlap.py reads them).
        self.forward_spans: deque[tuple[float, float]] = deque(maxlen=8192)
        log.info("%s: %s", self.hardware.summary(), self.describe_choices())

    def describe_choices(self) -> str:
        """One line: each hardware-dependent setting, its value, and why."""
        def text(v):
            return str(v).removeprefix("torch.") if not isinstance(v, bool) else ("on" if v else "off")
        return "; ".join(f"{k} {text(c.value)} ({c.reason})" for k, c in self.choices.items())

    @property
    def num_pages(self) -> int:
        return self.pool.spec.num_pages

    def _pool_spec(self) -> KVPoolSpec:
        m, cfg = self.model_cfg, self.cfg
        if cfg.max_total_tokens is not None:
            tokens = cfg.max_total_tokens
        else:
            per_token = m.kv_bytes_per_token(torch.empty((), dtype=self.dtype).element_size())
            tokens = int(cfg.kv_cache_gb * (1 << 30)) // per_token
        num_pages = max(1, tokens // cfg.page_size)
        return KVPoolSpec(m.num_layers, num_pages, cfg.page_size, m.num_kv_heads, m.head_dim, self.dtype,
                          self.choices["KV layout"].value)

    def _load_model(self, context_len: int) -> torch.nn.Module:
        t0 = time.perf_counter()
        cls = model_class(self.model_cfg)
        # Build without running random init (meta device), then materialise and fill from disk.
        with torch.device("meta"):
            model = cls(self.model_cfg, context_len)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.rope = type(model.rope)(self.model_cfg.rope, self.model_cfg.head_dim, context_len).to(self.device)
        model.load_weights(iter_weights(self.model_cfg.path, self.dtype))
        model.eval()
        if self._weight_prepack():
            ops = self.cpu_ops if self.dtype == torch.float32 else None
            log.info("prepacked %d linear layers (%s)", model.prepack(ops),
                     "oneDNN layout" if ops is None else f"{ops.LEVEL} kernel's panels of {ops.LINEAR_PANEL}")
        log.info("loaded %s (%s, %s) in %.1fs", self.model_cfg.path, self.dtype, self.device,
                 time.perf_counter() - t0)
        return model

    def _weight_prepack(self) -> bool:
        graphs = graph_enabled(self.cfg, self.device)
        kernels = self.cpu_ops is not None
        auto = choose_weight_prepack(self.hardware, self.dtype, graphs, kernels)
        want = self.cfg.enable_weight_prepack
        self.choices["weight prepack"] = auto if want is None else Choice(want, "--enable/--disable-weight-prepack")
        if want is None:
            return auto.value
        supported = choose_weight_prepack(self.hardware, self.dtype, False, kernels)
        if want and not supported.value:
            raise InvalidRequest("--enable-weight-prepack needs bf16 on a CPU whose oneDNN supports bf16, or fp32 "
                                 f"with the CPU kernels on ({supported.reason})", "enable_weight_prepack")
        if want and graph_enabled(self.cfg, self.device):
            raise InvalidRequest("--enable-weight-prepack and decode graphs (--enable-graph) do not go together: "
                                 "the compiled graph manages its own weights", "enable_weight_prepack")
        return want

    def _cpu_kernels(self):
        """kernels.cpu's module when the fused CPU kernels are to be used, else None."""
        want = self.cfg.enable_cpu_kernels
        auto = choose_cpu_kernels(self.hardware, graph_enabled(self.cfg, self.device))
        self.choices["CPU kernels"] = auto if want is None else Choice(want, "--enable/--disable-cpu-kernels")
        if want is False:
            return None
        if not auto.value:
            if want:
                raise InvalidRequest("--enable-cpu-kernels needs a CPU device with decode graphs off "
                                     "(compiled graphs trace the torch code)", "enable_cpu_kernels")
            return None
        from tandem.kernels.cpu import load

        ops = load()
        if ops is None and want:
            raise InvalidRequest("--enable-cpu-kernels: the CPU kernels could not be built here (see the log; "
                                 "`python -m tandem.kernels.cpu -v` shows the compiler's output)", "enable_cpu_kernels")
        if ops is None:
            self.choices["CPU kernels"] = Choice(False, "they could not be built here (see the warning above)")
        elif want is None:
            self.choices["CPU kernels"] = Choice(True, f"{ops.LEVEL} variant")
        return ops

    # --- one step ----------------------------------------------------------------------------
    def build_context(self, batch: StepBatch) -> ForwardContext:
        ps = self.cfg.page_size
        seqs = batch.seqs
        input_ids: list[int] = []
        positions: list[int] = []
        seq_of_token: list[int] = []
        logits_rows: list[int] = []
        q_lens, prefix_lens, kv_lens = [], [], []
        for i, s in enumerate(seqs):
            n = len(s.input_ids)
            input_ids.extend(s.input_ids)
            positions.extend(range(s.prefix_len, s.prefix_len + n))
            seq_of_token.extend([i] * n)
            if s.num_drafts:
                logits_rows.extend(range(len(input_ids) - n, len(input_ids)))   # verify every position
            elif s.sample:
                logits_rows.append(len(input_ids) - 1)
            q_lens.append(n)
            prefix_lens.append(s.prefix_len)
            kv_lens.append(s.prefix_len + n)
        max_pages = max(-(-k // ps) for k in kv_lens)
        table = [s.req.pages[:max_pages] + [0] * (max_pages - min(len(s.req.pages), max_pages)) for s in seqs]
        dev = self.device
        page_table = torch.tensor(table, dtype=torch.int32, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        seq_t = torch.tensor(seq_of_token, dtype=torch.int64, device=dev)
        out_slots = page_table[seq_t, pos_t // ps].to(torch.int64) * ps + pos_t % ps
        ctx = ForwardContext(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=pos_t,
            out_slots=out_slots,
            logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            page_table=page_table,
            q_lens=q_lens,
            prefix_lens=prefix_lens,
            kv_lens=kv_lens,
            is_decode=batch.is_decode,
            attn=self.attn,
            after_layer=self.layer_hook(batch) if self.layer_hook is not None else None,
            lora=LoraBatch.build([s.req.lora for s in seqs], q_lens, dev, self.lora_stack)
            if any(s.req.lora is not None for s in seqs) else None,
        )
        self.attn.prepare(ctx)
        return ctx

    def run(self, batch: StepBatch) -> list[SampledToken]:
        """Run one forward pass; returns a token for each sampling sequence, in batch order. The
        grammar masks, if any, are computed on a helper thread while the forward pass runs."""
        step = self.prepare(batch)
        if step.masks is not None:
            self._mask_thread().submit(step.masks.fill)
        return self.execute(step)

    def _mask_thread(self) -> ThreadPoolExecutor:
        if self._masks is None:
            self._masks = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._masks

    def close(self) -> None:
        """Stop the grammar-mask thread (if one started). Safe twice."""
        if self._masks is not None:
            self._masks.shutdown(wait=True)
            self._masks = None

    def prepare(self, batch: StepBatch) -> PreparedStep:
        """Build the step's tensors from scheduler bookkeeping (on the thread that owns it)."""
        t0 = time.perf_counter()
        ctx = self.build_context(batch)
        sampling = batch.sampling
        sb = futures = None
        if sampling:
            sb = SamplingBatch.build(
                params=[s.req.params for s in sampling],
                prompt_ids=[s.req.prompt_ids for s in sampling],
                output_ids=[s.req.output_ids for s in sampling],
                generators=[self._generator(s.req.rid, s.req.params.seed) for s in sampling],
                vocab_size=self.model_cfg.vocab_size,
                device=self.device,
            )
            futures = torch.tensor([s.future for s in sampling], dtype=torch.int64, device=self.device)
        masks = MaskJob.for_step(sampling, self.model_cfg.vocab_size) if sampling else None
        return PreparedStep(batch, ctx, sampling, sb, futures, batch.has_future_inputs, time.perf_counter() - t0,
                            masks)

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> list[SampledToken]:
        """Resolve future inputs, run the forward pass and sample; thread-agnostic, but steps must
        execute one at a time in the order they were prepared."""
        t1 = time.perf_counter()
        self.last_batch = step.batch
        ctx = step.ctx
        if step.has_future_inputs:
            ids = ctx.input_ids
            ctx.input_ids = torch.where(ids < 0, self.future_map[(-ids - 1).clamp_(min=0)], ids)
        logits = self.forward(ctx)   # with nothing to sample, still writes every layer's KV
        t2 = time.perf_counter()
        if not step.sampling:
            self.forward_spans.append((t1, t2))
            self.last_timings = StepTimings(step.prepare_s, t2 - t1, 0.0)
            return []
        bias = step.masks.wait(self.device) if step.masks is not None else None
        wait_s = time.perf_counter() - t2
        if any(s.num_drafts for s in step.sampling):   # speculative verification (never with overlap)
            result = self._verify_and_sample(logits, step.sampling, bias)
            t3 = time.perf_counter()
            self.forward_spans.append((t1, t3))
            self.last_timings = StepTimings(step.prepare_s, t2 - t1, t3 - t2, wait_s)
            return result
        if bias is not None:
            step.sampling_batch.grammar_bias = bias
        out = self.sampler(logits, step.sampling_batch)
        self.future_map[step.futures] = out.token_ids
        result = self._tokens(out, step.sampling)
        t3 = time.perf_counter()
        self.forward_spans.append((t1, t3))
        self.last_timings = StepTimings(step.prepare_s, t2 - t1, t3 - t2, wait_s)
        return result

    def _verify_and_sample(self, logits: torch.Tensor, sampling: list[SeqStep],
                           bias: torch.Tensor | None = None) -> list[SampledToken | list[SampledToken]]:
        """Sequences with drafts own num_drafts + 1 logits rows each, the others one."""
        plain_rows, spec_rows, row = [], [], 0
        for s in sampling:
            n = s.num_drafts + 1
            (spec_rows if s.num_drafts else plain_rows).extend(range(row, row + n))
            row += n
        plain = [s for s in sampling if not s.num_drafts]
        spec = [s for s in sampling if s.num_drafts]
        dev = self.device
        plain_out: list[SampledToken] = []
        if plain:
            sb = SamplingBatch.build(
                params=[s.req.params for s in plain], prompt_ids=[s.req.prompt_ids for s in plain],
                output_ids=[s.req.output_ids for s in plain],
                generators=[self._generator(s.req.rid, s.req.params.seed) for s in plain],
                vocab_size=self.model_cfg.vocab_size, device=dev)
            if bias is not None:
                sb.grammar_bias = bias[torch.tensor(plain_rows, device=dev)]
            plain_out = self._tokens(self.sampler(logits[torch.tensor(plain_rows, device=dev)], sb), plain)
        spec_out = iter(verify(
            logits[torch.tensor(spec_rows, device=dev)],
            [VerifyRow(s.req.params, s.input_ids[-s.num_drafts:], self._generator(s.req.rid, s.req.params.seed))
             for s in spec],
            self.model_cfg.vocab_size,
            bias[torch.tensor(spec_rows, device=dev)] if bias is not None else None))
        it = iter(plain_out)
        return [next(spec_out) if s.num_drafts else next(it) for s in sampling]

    @staticmethod
    def _tokens(out, sampling: list[SeqStep]) -> list[SampledToken]:
        tokens = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result = []
        for i, s in enumerate(sampling):
            k = s.req.params.top_logprobs
            top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if top_ids is not None and k else None
            lp = logprobs[i] if logprobs is not None and s.req.params.logprobs else None
            result.append(SampledToken(tokens[i], lp, top))
        return result

    def forward(self, ctx: ForwardContext) -> torch.Tensor:
        """The model's logits for `ctx`: from a captured graph when one fits (a decode step of at most
        the largest captured size), else eager."""
        logits = self.graphs.forward(ctx) if self.graphs is not None else None
        return self.model(ctx) if logits is None else logits

    def _generator(self, rid: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(rid)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[rid] = gen
        return gen

    def skip_draws(self, rid: str, seed: int | None, draws: int) -> None:
        """Advance a seeded request's generator as if it had sampled `draws` tokens here (the
        sampler uses one uniform draw per sampled token): a decode worker continuing after the
        prefill worker's first token then draws exactly what a co-located run would."""
        gen = self._generator(rid, seed)
        if gen is not None and draws:
            torch.empty(draws, device=self.device).uniform_(generator=gen)

    def release(self, rid: str) -> None:
        """Forget per-request state (the seeded generator) once a request has finished."""
        self._generators.pop(rid, None)
