"""Speculative decoding's hooks into a step: attach drafts to decode rows, account what was accepted.

    batch = scheduler.schedule()
    speculator.attach(batch)          # decode rows become [last token, d1..dk], pages reserved
    sampled = runner.run(batch)       # one forward; verify() turns each such row into 1..k+1 tokens
    speculator.observe(batch, sampled)
    scheduler.on_step_done(batch, sampled)   # keeps accepted KV, shrinks pages of rejected drafts

Structured output: drafts are cut at the first token the request's grammar refuses, and the
verify step's masks walk the matcher over the remaining drafts and roll it back
(engine/runner/grammar_mask.py); the tokens emitted are then consumed like any step's.

Which rows speculate: decode rows (one new token at the end of a running request, in decode and in
mixed steps; a mixed step's drafts come on top of its chunked-prefill token budget) without
repetition/frequency/presence penalties, with room left in max_tokens and the context. Drafts use
only free pages (never evicting the prefix cache, never retracting anyone); the pages of rejected
drafts go back after the step. Speculation runs in the engine's synchronous step (overlap
scheduling, when it lands, is to be turned off while speculating: a verify step's input depends on
the previous step's accepted tokens).
"""

from __future__ import annotations

import time
from typing import Protocol

from tandem.engine.kvcache.kv_manager import KVManager
from tandem.engine.scheduler.batch import SampledToken, SeqStep, StepBatch
from tandem.engine.scheduler.request import Request
from tandem.engine.spec.adaptive import SpecGate
from tandem.engine.spec.stats import SpecStats


class Proposer(Protocol):
    def propose_batch(self, reqs: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] draft tokens continuing reqs[i].all_ids."""

    def release(self, rid: str) -> None:
        """Forget a request's proposer state (its draft KV)."""

    def check_idle(self) -> None: ...


class Speculator:
    def __init__(self, proposer: Proposer, num_draft_tokens: int, kv: KVManager, context_len: int,
                 adaptive: bool = True):
        self.proposer = proposer
        self.k = num_draft_tokens
        self.kv = kv
        self.context_len = context_len
        self.gate = SpecGate(adaptive=adaptive)
        self.stats = SpecStats(num_draft_tokens)
        self._started: float | None = None
        self._timed = False

    def attach(self, batch: StepBatch) -> None:
        """Give the batch's eligible decode rows their drafts (in place), if the gate says it pays.
        Mixed steps speculate too; only pure decode steps are timed for the gate."""
        rows = [s for s in batch.seqs if _is_decode_row(s)]
        self._timed = len(rows) == len(batch.seqs)
        self._started = time.perf_counter() if rows else None
        eligible = [s for s in rows if _may_speculate(s.req)]
        ks = [self._room(s.req) for s in eligible]
        picked = [(s, k) for s, k in zip(eligible, ks, strict=True) if k > 0]
        if not picked:
            return
        drafts = self.proposer.propose_batch([s.req for s, _ in picked], [k for _, k in picked])
        if not self.gate.decide(len(rows), sum(len(d) for d in drafts)):
            return
        for (seq, _), d in zip(picked, drafts, strict=True):
            n = len(seq.req.all_ids)
            if d and seq.req.grammar is not None:
                d = d[:seq.req.grammar.accepts(d)]   # structured output: a draft the grammar refuses is rejected
            if d and not self.kv.ensure_capacity(seq.req, n + len(d)):
                d = d[:len(seq.req.pages) * self.kv.page_size - n]   # rows before took the free pages
            if d:
                seq.input_ids = seq.input_ids + d
                seq.num_drafts = len(d)

    def _room(self, req: Request) -> int:
        """Drafts this request may take: bounded by max_tokens, the context and free pages."""
        n = len(req.all_ids)
        k = min(self.k, req.remaining_tokens - 1, self.context_len - n)
        have = len(req.pages) * self.kv.page_size - n
        free = self.kv.allocator.num_free * self.kv.page_size
        return max(0, min(k, have + free))

    def observe(self, batch: StepBatch, sampled: list[SampledToken | list[SampledToken]]) -> None:
        """After the forward pass, before the scheduler's bookkeeping: count and time the step."""
        if self._started is None:
            return
        seconds = time.perf_counter() - self._started
        self._started = None
        drafted = accepted = 0
        it = iter(sampled)
        for seq in batch.seqs:
            tok = next(it) if seq.sample else None
            if seq.num_drafts and isinstance(tok, list):
                drafted += seq.num_drafts
                accepted += len(tok) - 1
                self.stats.record_row(seq.num_drafts, len(tok) - 1)
        if drafted:
            self.stats.verify_steps += 1
        else:
            self.stats.plain_steps += 1
        if self._timed:
            self.gate.observe(len(batch.seqs), drafted, accepted, seconds)

    def release(self, rid: str) -> None:
        self.proposer.release(rid)

    def check_idle(self) -> None:
        self.proposer.check_idle()


def _is_decode_row(s: SeqStep) -> bool:
    return s.decode and s.sample and len(s.input_ids) == 1 and s.prefix_len == len(s.req.all_ids) - 1


def _may_speculate(req: Request) -> bool:
    # Penalties depend on the tokens before each position, which verify() does not model.
    p = req.params
    return p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
