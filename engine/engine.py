"""The co-located engine: tokenizer + scheduler + model runner behind a small Python API.

    engine = LLMEngine(EngineConfig(model="smollm2-135m"))
    print(engine.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0].text)

`add_request` / `step` / `abort` are the primitives (a service drives them from its own loop);
`generate` and `stream` are conveniences built on them. Not thread-safe: one thread drives it.

With overlap scheduling (`EngineConfig.enable_overlap_schedule`) `step` plans and launches step N+1
on a forward thread before it finishes step N (sampling results, stop checks, detokenization), so that
CPU work runs while the model computes; the deltas a call returns are then those of the previous
forward pass. See engine/scheduler/future.py for how step N+1 refers to tokens step N is sampling.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.errors import GrammarViolation, InvalidRequest, ResourceExhausted
from tandem.engine.hardware import choose_overlap
from tandem.engine.kvcache.kv_pool import KVPoolSpec
from tandem.engine.kvcache.tiers.event_link import EventLink
from tandem.engine.kvcache.tiers.link import TierLink, model_fingerprint, open_store
from tandem.engine.lora.registry import LoraRegistry
from tandem.engine.models.config import ModelConfig, load_sampling_defaults
from tandem.engine.models.source import resolve_model
from tandem.engine.outputs import FinishReason, GenerationResult, RequestOutput, TokenLogprob, Usage
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken, StepBatch
from tandem.engine.scheduler.request import Request
from tandem.engine.scheduler.scheduler import Scheduler
from tandem.engine.spec.factory import create_speculator
from tandem.engine.structured.matcher import GrammarBackend
from tandem.engine.tokenizer.detokenizer import IncrementalDetokenizer, StopChecker
from tandem.engine.tokenizer.tokenizer import Tokenizer
from tandem.kvblocks.keys import Namespace

log = logging.getLogger(__name__)

LOAD_WAIT_S = 0.01   # an idle step's wait for a load from the KV tiers (new commands wait this long at most)


@dataclass(eq=False)
class _Tracked:
    req: Request
    detok: IncrementalDetokenizer
    stop: StopChecker


class LLMEngine:
    def __init__(self, cfg: EngineConfig, kv_allocator: Callable[[KVPoolSpec], torch.Tensor] | None = None):
        cfg.validate()
        self.cfg = cfg
        self.model_path = resolve_model(cfg.model)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        self.tokenizer = Tokenizer(self.model_path)
        # What a request's unset sampling fields become: the model's generation_config.json, else Tandem's.
        self.sampling_defaults = load_sampling_defaults(self.model_path)
        model_ctx = self.model_config.max_position_embeddings
        self.context_len = min(cfg.context_length or model_ctx, model_ctx)
        self.runner = ModelRunner(cfg, self.model_config, self.context_len, kv_allocator)
        self.loras = LoraRegistry(cfg, self.model_config, self.runner.dtype, self.runner.device,
                                  on_stack=lambda stack: setattr(self.runner, "lora_stack", stack),
                                  cpu_ops=self.runner.cpu_ops)
        self.kv_tiers = self._open_kv_tiers() if cfg.kv_tiers_enabled else None
        self.kv_events: EventLink | None = None   # open_kv_events (a worker publishing KV events)
        self.scheduler = Scheduler(cfg, self.runner.num_pages, self.context_len, tiers=self.kv_tiers)
        self.spec = create_speculator(cfg, self.scheduler.kv, self.context_len, self.model_config, self.runner)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        # A verify step's input is the previous step's accepted tokens: speculation runs synchronously.
        # With tiers, overlap stays off: with a forward pass in flight, the pages a request released
        # in the meantime may still be written by that pass, and a demotion reading them (scheduler
        # thread) or a load writing them (loader thread) would race it (docs/kv-cache.md, known limits).
        self.overlap = overlap_enabled(cfg, self.runner.device) and self.spec is None and self.kv_tiers is None
        self._forward = ThreadPoolExecutor(1, thread_name_prefix="forward") if self.overlap else None
        self._inflight: tuple[StepBatch, Future] | None = None
        self.num_overlapped_steps = 0   # steps launched before the previous one's tokens were known
        self._grammars: GrammarBackend | None = None   # structured output; built on first use

    # --- primitives --------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams, rid: str | None = None,
                    priority: int = 0, resume_ids: Sequence[int] = (), lora: str | None = None) -> str:
        """Validate and queue a request; returns its id. Raises InvalidRequest / ResourceExhausted.
        A full queue may turn away a queued request of lower priority instead: the caller collects it
        with `take_evicted` (already forgotten here) and answers it."""
        req = self.make_request(prompt, params, rid, priority, resume_ids, lora)
        try:
            self.scheduler.add(req)
        except Exception:
            self.forget(req.rid)
            raise
        return req.rid

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams, rid: str | None = None,
                     priority: int = 0, resume_ids: Sequence[int] = (), lora: str | None = None) -> Request:
        """Validate, tokenize and start tracking a request without queueing it (disaggregated
        workers queue it themselves). Unset sampling fields get `sampling_defaults` here, the one place
        every entry point (gRPC workers, `tandem generate`, this API) passes. Raises InvalidRequest.

        `resume_ids`: output tokens another worker already produced and streamed (the router's
        mid-stream migration). The request continues after prompt + them as if it had produced them
        here: they count against max_tokens, the detokenizer replays them (their text, held-back
        stop-string prefixes and half characters included, is not emitted again), a seeded generator
        skips their draws and a grammar consumes them. Output-only penalties (frequency, presence)
        see them as prompt: docs/resilience.md. `lora`: the name of the adapter to apply (None: the
        base model)."""
        adapter = self.loras.acquire(lora, self.loras_in_use()) if lora else None
        params = self.sampling_defaults.fill(params)
        if resume_ids:
            if params.max_tokens <= len(resume_ids):
                raise InvalidRequest(f"{len(resume_ids)} resumed tokens leave nothing of max_tokens "
                                     f"{params.max_tokens}", "resume_ids")
            params = dataclasses.replace(params, max_tokens=params.max_tokens - len(resume_ids))
        params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty", "prompt")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = [int(t) for t in prompt]
            bad = [t for t in prompt_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise InvalidRequest(f"token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}", "prompt")
        resumed = [int(t) for t in resume_ids]
        bad = [t for t in resumed if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequest(f"resumed token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}",
                                 "resume_ids")
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        if rid in self._tracked:
            raise InvalidRequest(f"request id {rid!r} is already in flight", "request_id")
        req = Request(rid, prompt_ids + resumed, params, priority=priority, lora=adapter)
        self.scheduler.validate(req)
        if params.structured is not None:
            req.grammar = self.grammar_backend().matcher(params.structured)
            if req.grammar.consume(resumed) != len(resumed):
                raise InvalidRequest("the resumed tokens do not match the structured-output constraint", "resume_ids")
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop)
        for t in resumed:  # the same appends the first worker made: the same window, held text and offsets
            detok.append(t)
        if resumed and not params.is_greedy:
            self.runner.skip_draws(rid, params.seed, len(resumed))
        self._tracked[rid] = _Tracked(req, detok, StopChecker(params, self.eos_token_ids))
        return req

    def lora_for(self, model: str) -> str | None:
        """The adapter a request's `model` names here, or None (empty, or the base model's name)."""
        return model if model and model in self.loras.known else None

    def loras_in_use(self) -> set[str]:
        """Adapters of the requests in flight (running or waiting): never unloaded or evicted."""
        return {t.req.lora.name for t in self._tracked.values() if t.req.lora is not None}

    def load_lora(self, name: str, path: str) -> None:
        """Runtime load (between steps: call on the engine thread). Raises InvalidRequest saying what is
        wrong with the adapter, ResourceExhausted when every loaded adapter is in use."""
        self.loras.register(name, path, self.loras_in_use())

    def unload_lora(self, name: str) -> None:
        """Runtime unload. Raises ModelNotFound (unknown), Conflict (requests in flight use it)."""
        self.loras.unregister(name, self.loras_in_use())

    def lora_usage(self) -> list:
        """Every known adapter: loaded or not, requests running and waiting (engine.lora.registry.AdapterUse)."""
        sched = self.scheduler
        running = {r.rid for r in (*sched.running, *sched.prefilling)}
        names = [(t.req.rid in running, t.req.lora.name) for t in self._tracked.values() if t.req.lora is not None]
        return self.loras.usage([n for run, n in names if run], [n for run, n in names if not run])

    def grammar_backend(self) -> GrammarBackend:
        """This worker's grammar compiler (the tokenizer in llguidance's form, ~0.3 s the first time)."""
        if self._grammars is None:
            self._grammars = GrammarBackend(self.model_path / "tokenizer.json", sorted(self.eos_token_ids),
                                            self.model_config.vocab_size, compact=not self.cfg.enable_any_whitespace)
        return self._grammars

    def take_evicted(self) -> list[tuple[str, ResourceExhausted]]:
        """Requests a higher-priority newcomer pushed out of the full waiting queue since the last
        call (their resources are freed): (request id, the error their caller gets)."""
        out = []
        for req, err in self.scheduler.take_evicted():
            self.forget(req.rid)
            out.append((req.rid, err))
        return out

    def forget(self, rid: str) -> None:
        """Stop tracking a request that never got queued (or whose resources the caller freed)."""
        self._tracked.pop(rid, None)
        self._release(rid)

    def _release(self, rid: str) -> None:
        self.runner.release(rid)
        if self.spec is not None:
            self.spec.release(rid)

    def start_decoding(self, req: Request, first: SampledToken) -> RequestOutput:
        """A request whose prompt KV arrived in its pages joins the running batch with its first
        token (sampled by the prefill worker); returns the delta for that token. Raises
        GrammarViolation (nothing changed) if the request's grammar refuses that token."""
        if req.grammar is not None and req.grammar.accepts([first.token_id]) != 1:
            raise GrammarViolation(f"the prefill worker's first token {first.token_id} is not allowed by the "
                                   "request's structured-output constraint")
        if req.grammar is not None:
            req.grammar.consume([first.token_id])
        req.output_ids.append(first.token_id)
        req.num_computed = len(req.prompt_ids)
        if not req.params.is_greedy:
            self.runner.skip_draws(req.rid, req.params.seed, 1)
        self.scheduler.add_running(req)
        return self._emit(self._tracked[req.rid], first)

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    def has_work(self) -> bool:
        """Something to schedule, or a launched forward pass whose results are not processed yet."""
        return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns a delta for every request that produced a token."""
        return [self._emit(self._tracked[req.rid], tok) for _, done in self.advance() for req, tok in done]

    def advance(self) -> list[tuple[StepBatch, list[tuple[Request, SampledToken]]]]:
        """The step primitive under `step`: schedule and run a step — with overlap, launch it and
        finish the one launched before — and return each finished step with the tokens its
        requests sampled (not yet checked for stop conditions; a prefill worker sends KV instead)."""
        if self._forward is None:
            batch = self.scheduler.schedule()
            if batch is None:
                self._wait_for_loads()
                return []
            if self.spec is not None:
                self.spec.attach(batch)
            sampled = self.runner.run(batch)
            if self.spec is not None:
                self.spec.observe(batch, sampled)
            return [(batch, _consume_grammar(self.scheduler.on_step_done(batch, sampled)))]
        batch = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        done = []
        step = None
        if batch is not None:
            if prev is not None and _needs_history(batch):
                done.append(self._finish(prev))  # penalties read every previous token: no overlap
                prev = None
            step = self.runner.prepare(batch)
            self.num_overlapped_steps += step.has_future_inputs
            self._inflight = (batch, self._forward.submit(_timed, self.runner.execute, step))
        try:
            if prev is not None:
                done.append(self._finish(prev))
            elif batch is None:
                self._wait_for_loads()
        finally:
            # The step just launched samples from masks that depend on the tokens `prev` sampled:
            # computed here, once those are consumed, while its forward pass runs.
            if step is not None and step.masks is not None:
                step.masks.fill()
        return done

    def _wait_for_loads(self) -> None:
        # Nothing could be scheduled: if requests wait only for their prefix to load from the KV
        # tiers, wait a little for one rather than spin (the caller steps again right away).
        if self.scheduler.kv.num_loading:
            self.scheduler.kv.wait_loads(LOAD_WAIT_S)

    def _finish(self, inflight: tuple[StepBatch, Future]) -> tuple[StepBatch, list[tuple[Request, SampledToken]]]:
        batch, fut = inflight
        sampled, elapsed = fut.result()
        return batch, _consume_grammar(self.scheduler.on_step_done(batch, sampled, elapsed))

    def kv_namespace(self) -> Namespace:
        """This worker's block-key space (model fingerprint, KV dtype, page geometry): the tiers'
        keys and the KV events' keys, which a router needs to hash prompts the same way."""
        spec = self.runner.pool.spec
        return Namespace(model_fingerprint(self.model_path), str(spec.dtype).removeprefix("torch."), spec.page_size,
                         spec.num_layers, spec.kv_heads, spec.head_dim)

    def open_kv_events(self) -> EventLink:
        """Start following the prefix cache (L1) and the tiers below it for KV events (a worker does,
        before it serves; the caller `open`s the link with its worker id and carries the messages).
        Events need keys, so the prefix cache computes them from now on, tiers or not."""
        assert self.kv_events is None, "KV events opened twice"
        link = EventLink(self.kv_tiers.namespace if self.kv_tiers is not None else self.kv_namespace())
        link.attach(self.scheduler.kv.cache, self.kv_tiers.store if self.kv_tiers is not None else None)
        self.kv_events = link
        return link

    def _open_kv_tiers(self) -> TierLink:
        """The store below the KV pool (L2 host memory, L3 disk) and its link to the prefix cache.
        Raises ValueError naming the flag when a tier cannot start."""
        cfg = self.cfg
        ns = self.kv_namespace()
        pool = self.runner.pool
        store = open_store(ns, pool.block_bytes, cfg.kv_host_cache_gb, cfg.kv_disk_cache_dir, cfg.kv_disk_cache_gb)
        log.info("KV tiers below the pool: %s", ", ".join(
            f"{t.tier.label} {t.capacity_bytes / (1 << 30):.3g} GiB" for t in store.stats().tiers))
        sync = None
        if self.runner.device.type == "cuda":
            # The loader's copies run on its thread's current stream; a job is done once they are.
            sync = torch.cuda.current_stream(self.runner.device).synchronize
        return TierLink(store, ns, pool.pack_page, pool.unpack_page, sync_writes=sync,
                        write_through=cfg.kv_write_policy == "write_through")

    def close(self) -> None:
        """Wait for a launched forward pass and stop the forward thread (overlap only); close the KV
        tiers (their pending disk writes finish first, within a timeout). Safe twice."""
        if self._forward is not None:
            self._drain()
            self._forward.shutdown(wait=True)
        self.runner.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.kv_tiers is not None:
            self.kv_tiers.close()

    def abort(self, rid: str) -> bool:
        """Stop a request and free its resources. Returns False if it was not in flight."""
        tracked = self._tracked.pop(rid, None)
        if tracked is None:
            return False
        self.scheduler.finish(tracked.req, FinishReason.ABORT)
        self._release(rid)
        return True

    def check_idle(self) -> None:
        """Idle self-check: with nothing in flight, every KV page and request slot is free."""
        assert not self._tracked, f"requests still tracked: {list(self._tracked)[:5]}"
        assert self._inflight is None, "a forward pass is still in flight"
        self.scheduler.check_idle()
        if self.spec is not None:
            self.spec.check_idle()

    def _emit(self, t: _Tracked, tok: SampledToken | list[SampledToken]) -> RequestOutput:
        """The delta for the newest token(s) of `t.req`, already in its output_ids (several after a
        verified speculative step). A stop condition met inside a run of tokens cuts the output
        right after the token that met it, as token-by-token decoding would have."""
        toks = tok if isinstance(tok, list) else [tok]
        req = t.req
        base = len(req.output_ids) - len(toks)
        text, ids, lp = "", [], []
        reason: FinishReason | None = None
        matched: str | int | None = None
        for i, tk in enumerate(toks):
            n = base + i + 1
            reason = t.stop.check(req.output_ids if n == len(req.output_ids) else req.output_ids[:n])
            stopped_by_token = reason is FinishReason.STOP
            # A stop/EOS token ends the text without contributing to it.
            text += "" if stopped_by_token else t.detok.append(tk.token_id)
            matched = t.stop.matched_stop_token if stopped_by_token else None
            if t.detok.finished and not stopped_by_token:  # a stop string wins over the length limit
                reason, matched = FinishReason.STOP, t.detok.matched_stop
            ids.append(tk.token_id)
            if req.params.logprobs and tk.logprob is not None:
                lp.append(TokenLogprob(tk.token_id, tk.logprob, tk.top or []))
            if reason is not None:
                del req.output_ids[n:]      # drafts accepted past the stop are not output
                break
        if req.grammar is not None and req.grammar.dead:
            # No legal token was left (its mask let anything through; a refused token was taken
            # back out): never passed off as a complete value, even when EOS came out.
            reason, matched = FinishReason.GRAMMAR_DEAD_END, None
        elif reason is None and req.grammar is not None and req.grammar.complete:
            reason = FinishReason.STOP                    # the value is complete and nothing may follow
        if reason is not None and t.detok.matched_stop is None:
            text += t.detok.flush()
        out = RequestOutput(req.rid, ids, text, lp or None, reason, matched)
        if reason is not None:
            self.scheduler.finish(req, reason)
            self._release(req.rid)
            del self._tracked[req.rid]
            out.usage = Usage(len(req.prompt_ids), len(req.output_ids), req.cached_tokens)
        return out

    # --- conveniences ------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams],
                 loras: Sequence[str | None] | None = None) -> list[GenerationResult]:
        """Run a batch to completion (continuous batching inside); results in prompt order. `loras`:
        each prompt's adapter name (None: the base model)."""
        self._require_exclusive("generate")
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequest("need one SamplingParams per prompt, or one for all", "params")
        names = list(loras) if loras is not None else [None] * len(prompts)
        if len(names) != len(prompts):
            raise InvalidRequest("need one adapter name (or None) per prompt", "loras")
        rids = []
        try:
            for p, sp, name in zip(prompts, plist, names, strict=True):
                rids.append(self.add_request(p, sp, lora=name))
        except Exception:
            for rid in rids:
                self.abort(rid)
            raise
        acc: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
        pending = set(rids)
        while pending:
            for out in self.step():
                acc[out.rid].append(out)
                if out.finished:
                    pending.discard(out.rid)
        self._drain()
        return [_collect(rid, acc[rid]) for rid in rids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Yield deltas of one request as they come."""
        self._require_exclusive("stream")
        rid = self.add_request(prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.rid == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)  # no-op when it finished; frees everything if the caller stopped early
            self._drain()

    def _drain(self) -> None:
        # The step launched after a request's last token belongs to nobody any more.
        if self._inflight is not None:
            self._finish(self._inflight)   # (at close, tokens of requests still in flight are dropped)
            self._inflight = None

    def _require_exclusive(self, what: str) -> None:
        # The conveniences drive `step` themselves and would swallow other requests' deltas.
        if self._tracked:
            raise RuntimeError(f"{what}() needs an idle engine; drive add_request/step yourself instead")


def overlap_enabled(cfg: EngineConfig, device) -> bool:
    """`enable_overlap_schedule` None means the device's default (engine/hardware.py): on for CUDA,
    off for CPU, where the forward pass and the scheduler share the same cores (docs/benchmarks.md)."""
    if cfg.enable_overlap_schedule is not None:
        return cfg.enable_overlap_schedule
    return bool(choose_overlap(device.type).value)


def _consume_grammar(done: list[tuple[Request, SampledToken | list[SampledToken]]]
                     ) -> list[tuple[Request, SampledToken | list[SampledToken]]]:
    """Advance each constrained request's matcher over the tokens it just got. A token the grammar
    refuses (its mask left no legal token) is taken back out of the output: the request then ends
    as a dead end (`_emit`) without it."""
    out = []
    for req, tok in done:
        if req.grammar is not None:
            toks = tok if isinstance(tok, list) else [tok]
            took = req.grammar.consume([t.token_id for t in toks])
            if took < len(toks):
                del req.output_ids[len(req.output_ids) - len(toks) + took:]
                tok = toks[:took]
        out.append((req, tok))
    return out


def _needs_history(batch: StepBatch) -> bool:
    # A row that decodes from a future token and whose sampling reads all previous tokens
    # (penalties) needs the previous step's results before its sampling inputs can be built.
    return any(s.sample and s.req.params.needs_penalties and any(t < 0 for t in s.input_ids) for s in batch.seqs)


def _timed(fn: Callable, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _collect(rid: str, deltas: list[RequestOutput]) -> GenerationResult:
    last = deltas[-1]
    logprobs = None
    if any(d.logprobs for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    assert last.finish_reason is not None and last.usage is not None
    return GenerationResult(
        rid=rid,
        text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids],
        finish_reason=last.finish_reason,
        usage=last.usage,
        logprobs=logprobs,
        matched_stop=last.matched_stop,
    )
