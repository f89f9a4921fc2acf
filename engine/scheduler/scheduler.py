"""Co-located continuous-batching scheduler (torch-free).

A step carries prefill chunks (continuing partially prefilled requests first, then admitting
waiting ones) and/or one token of every running request. With mixed chunks (the default) both go
in one step: the token budget `chunked_prefill_size` counts the decode rows, and the chunk is also
kept small enough that the step stays within `mixed_chunk_itl_factor` x a decode step, by the
measured costs in `StepCostModel` — so a new arrival's prefill slows running requests by a bounded
factor instead of stalling them. Without mixed chunks a step is either prefill (first whenever
anything can be admitted, as SGLang does) or decode.

Admission is conservative about memory: a request is admitted only if its prompt pages plus an
estimate of every running request's future pages (`remaining_tokens * new_token_ratio`) fit in the
available pages. The ratio decays while decoding goes smoothly; if decode still runs out of pages,
the request with the least progress is retracted (its computed pages go to the prefix cache, it goes
back to the front of the queue and is recomputed later) and the ratio jumps back up.

A step is *committed* when it is scheduled: its requests' `num_computed` advance and a prompt whose
last chunk it carries joins the running batch, as if the step had already run. The sampled tokens
arrive later through `on_step_done`. That is what lets overlap scheduling plan step N+1 while step N
runs: a running request whose newest token is still being sampled decodes from a future reference
(engine/scheduler/future.py). Without overlap nothing is in flight when the next step is planned, and
the two orders are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from time import monotonic, perf_counter
from typing import TYPE_CHECKING

from tandem.engine.config import EngineConfig
from tandem.engine.errors import InvalidRequest, ResourceExhausted
from tandem.engine.kvcache.kv_manager import KVManager, pages_for
from tandem.engine.outputs import FinishReason
from tandem.engine.scheduler.batch import SampledToken, SeqStep, StepBatch
from tandem.engine.scheduler.future import FutureSlots
from tandem.engine.scheduler.prefill_order import PrefillOrder, tokens_to_prefill
from tandem.engine.scheduler.queue_policy import PolicyQueue, QueuePolicy
from tandem.engine.scheduler.request import Request, RequestStatus
from tandem.engine.scheduler.stats import SchedulerStats
from tandem.engine.scheduler.step_cost import StepCostModel

if TYPE_CHECKING:
    from tandem.engine.kvcache.tiers.link import TierLink


class Scheduler:
    def __init__(self, cfg: EngineConfig, num_pages: int, context_len: int,
                 clock: Callable[[], float] = monotonic, tiers: TierLink | None = None):
        """`clock`: what request arrivals are on (queue age, TTFT deadlines); a simulation passes its own
        (bench/sched_sim.py). `tiers`: the KV store below the pool (KVManager), None: none."""
        self.cfg = cfg
        self.clock = clock
        self.context_len = context_len
        self.kv = KVManager(num_pages, cfg.page_size, cfg.max_running_requests, cfg.enable_prefix_cache, tiers)
        self.policy = QueuePolicy(cfg.enable_priority_scheduling, cfg.low_priority_values_first,
                                  cfg.priority_preemption_threshold)
        self.prefill_order = PrefillOrder(cfg.prefill_schedule_policy, cfg.prefill_max_wait_s)
        self.waiting: PolicyQueue[Request] = PolicyQueue(self.policy)
        # Queued requests a newcomer of higher priority pushed out of a full queue: already finished
        # (they held nothing); the owner takes them with `take_evicted` and answers their callers.
        self.evicted: list[tuple[Request, ResourceExhausted]] = []
        self.num_preemptions = 0
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.new_token_ratio = cfg.init_new_token_ratio
        self._ratio_step = (cfg.init_new_token_ratio - cfg.min_new_token_ratio) / max(1, cfg.new_token_ratio_decay_steps)
        self.num_retractions = 0
        self.cost = StepCostModel()
        self.futures = FutureSlots(cfg.max_running_requests)

    # --- intake ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request. Raises InvalidRequest if it can never run, ResourceExhausted if the queue
        is full and `req` is the one turned away; when a queued request of lower priority is turned
        away instead, it lands in `evicted`."""
        self.validate(req)
        cap = self.cfg.max_queued_requests
        # Retracted requests already streamed tokens: they are never turned away.
        out = self.waiting.offer(req, cap, evictable=lambda r: r.num_retractions == 0)
        if out is req:
            raise ResourceExhausted(self.policy.queue_full_message("waiting queue", cap, req))
        req.status = RequestStatus.WAITING
        if out is not None:
            self.finish(out, FinishReason.ABORT)
            self.evicted.append((out, ResourceExhausted(self.policy.evicted_message("waiting queue", cap, out, req))))

    def take_evicted(self) -> list[tuple[Request, ResourceExhausted]]:
        out, self.evicted = self.evicted, []
        return out

    def validate(self, req: Request) -> None:
        """Raise InvalidRequest if the request could never run on this worker."""
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequest("prompt is empty", "prompt")
        if n >= self.context_len:
            raise InvalidRequest(
                f"prompt has {n} tokens; this model's context length is {self.context_len}", "prompt")
        if n + req.params.max_tokens > self.context_len:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) exceeds the context "
                f"length {self.context_len}", "max_tokens")
        capacity = self.kv.num_pages * self.cfg.page_size
        if n + req.params.max_tokens > capacity:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) exceeds the KV cache "
                f"capacity of {capacity} tokens", "max_tokens")

    # --- planning ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def schedule(self) -> StepBatch | None:
        self.kv.poll_loads()   # requests whose prefix finished loading from the KV tiers may run now
        self._preempt_for_priority()
        if self.cfg.enable_mixed_chunk and self.running:
            # Decode rows first: their pages are secured (retracting if memory is short) before a
            # new prompt is admitted into what is left.
            decode = self._schedule_decode()
            cap = self.cfg.chunked_prefill_size - len(decode.seqs)
            budget = self.cost.prefill_budget(self.cfg.mixed_chunk_itl_factor, len(decode.seqs), self.cfg.page_size, cap)
            queue = self._prefill_queue()
            budget = max(budget, self._ttft_budget(queue, len(decode.seqs), cap))
            prefill = self._schedule_prefill(queue, budget)
            batch = StepBatch((prefill.seqs if prefill else []) + decode.seqs)
        else:
            batch = self._schedule_prefill(self._prefill_queue(), self.cfg.chunked_prefill_size)
            if batch is None and self.running:
                batch = self._schedule_decode()
        if batch is None or not batch.seqs:
            return None
        self._commit(batch)
        return batch

    def _commit(self, batch: StepBatch) -> None:
        """Book the step as run (see the module docstring); its tokens come with `on_step_done`."""
        batch.scheduled_at = perf_counter()
        for seq in batch.seqs:
            req = seq.req
            req.num_computed = seq.prefix_len + len(seq.input_ids)
            if not seq.sample:
                continue
            seq.future = req.future = self.futures.take()
            req.num_inflight += 1
            if req.status is RequestStatus.PREFILLING:
                self.prefilling.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)

    def _prefill_queue(self) -> list[Request]:
        """Prefilling and waiting requests in the order they are offered a step's prefill budget."""
        return self.prefill_order.order(self.prefilling, self.waiting, self.policy, self.clock())

    def _ttft_budget(self, queue: list[Request], decode_rows: int, cap: int) -> int:
        """Chunk tokens per mixed step that give every queued prompt its first token within
        `mixed_chunk_ttft_target_s` of its arrival, by the fitted step costs (0 when nothing waits
        for a first token, or the target is off). Prompts are taken in `queue`, the order the budget
        serves them: the i-th is done once the `T_i` tokens of those before it and its own are
        computed, in n steps of k tokens with n·k = T_i and n·(decode + c·k) = `left_i`,
        the time it has left; so k ≥ T_i·decode / (left_i − c·T_i), and the chunk is the largest
        such k over the queue. Under load the ITL bound gives way before a prompt misses the
        target. A prompt that cannot make it any more (not even in one step) is finished in this
        step with everything ahead of it, as without mixed chunks, which keeps its lateness as
        small as it can be; the prompts behind it keep their own deadlines."""
        target = self.cfg.mixed_chunk_ttft_target_s
        coef = self.cost.coefficients() if target and queue else None
        if coef is None:
            return 0
        a, b, c = coef
        decode = a + b * decode_rows
        if decode <= 0 or c <= 0:
            return 0
        now, need, done = self.clock(), 0, 0
        for r in queue:
            done += r.fill_len - r.num_computed if r.slot is not None else len(r.all_ids)
            if r.output_ids:
                continue  # retracted after its first token: no TTFT left to keep
            left = r.arrival + target - now - c * done
            need = max(need, done if left <= decode else math.ceil(done * decode / left))
        return min(cap, need)

    def _reserved_pages(self, reqs: Iterable[Request]) -> int:
        ps = self.cfg.page_size
        return sum(pages_for(int(r.remaining_tokens * self.new_token_ratio), ps) for r in reqs)

    def _schedule_prefill(self, queue: list[Request], budget: int) -> StepBatch | None:
        seqs: list[SeqStep] = []
        admitting = True  # after one waiting request did not fit, admit none behind it this step
        for req in queue:
            if budget <= 0:
                break
            if req.status is RequestStatus.WAITING:
                if self._loras_full(req):
                    continue   # its adapter would exceed --max-loras in flight: it waits, others go on
                if not (admitting and self._admit(req, bool(seqs))):
                    admitting = False
                    continue
            if self.kv.is_loading(req):
                continue   # its prefix is being loaded from the KV tiers: it waits, the others run
            seqs.append(self._chunk(req, budget))
            budget -= len(seqs[-1].input_ids)
        return StepBatch(seqs) if seqs else None

    def _loras_full(self, req: Request, pending: Iterable[Request] = ()) -> bool:
        """Whether admitting `req` would put more than `max_loras` distinct adapters in flight."""
        if req.lora is None:
            return False
        active = {r.lora.digest for r in (*self.running, *self.prefilling, *pending) if r.lora is not None}
        return req.lora.digest not in active and len(active) >= self.cfg.max_loras

    def _admit(self, req: Request, batched: bool) -> bool:
        """Move a waiting request to `prefilling` if a slot and its pages (keeping the reserve of the
        running and prefilling requests) are available; `batched`: the step already carries work."""
        if self.kv.slots.num_free_slots == 0 or req.num_inflight:
            return False  # in flight: retracted while its newest token is sampled; admitted once that lands
        fill = req.all_ids
        need = pages_for(len(fill), self.cfg.page_size)
        reserve = self._reserved_pages([*self.running, *self.prefilling, req])
        busy = self.running or self.prefilling or batched
        if busy and need + reserve > self.kv.available_pages:
            return False
        if not self.kv.admit(req, fill):
            return False
        self.waiting.remove(req)
        req.status = RequestStatus.PREFILLING
        self.prefilling.append(req)
        return True

    def _chunk(self, req: Request, budget: int) -> SeqStep:
        ids = req.all_ids
        start = req.num_computed
        end = min(req.fill_len, start + budget)
        return SeqStep(req, ids[start:end], start, sample=end == req.fill_len)

    def _schedule_decode(self) -> StepBatch:
        # Each request needs room for the KV of its newest token (position num_computed). Older
        # requests get pages first; the victims are the ones with the least progress. A request
        # whose in-flight token is its last (max_tokens) sits this step out: it is about to finish.
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.remaining_tokens <= 0:
                continue
            while req in self.running and not self.kv.ensure_capacity(req, req.num_computed + 1):
                self._retract(self._pick_victim())
        self.new_token_ratio = max(self.cfg.min_new_token_ratio, self.new_token_ratio - self._ratio_step)
        return StepBatch([SeqStep(r, [r.next_input], r.num_computed, True, decode=True)
                          for r in self.running if r.remaining_tokens > 0])

    def _pick_victim(self) -> Request:
        # Least decoded progress, then newest: loses the least work, as SGLang's retract does.
        return min(self.running, key=lambda r: (len(r.output_ids), -r.arrival))

    def _preempt_for_priority(self) -> None:
        """Retract running requests far enough below the head of the queue in priority (see
        QueuePolicy) until the head could be admitted, so that it is admitted in this step."""
        if not self.policy.enable_priority or not self.waiting:
            return
        head = self.waiting[0]
        while not (self.kv.slots.num_free_slots > 0 and self.admission_room(head)):
            victim = self.policy.preemption_victim(head, self.running, lambda r: len(r.output_ids))
            if victim is None:
                return
            ratio = self.new_token_ratio
            self._retract(victim)
            self.new_token_ratio = ratio  # a preemption says nothing about the memory estimate
            self.num_preemptions += 1

    def _retract(self, req: Request) -> None:
        # Co-located, `add` guarantees that one request alone always fits, so a lone request is
        # retracted only when pages are held outside this scheduler (a decode worker's requests
        # still receiving their KV); it is recomputed once those pages move on.
        self.running.remove(req)
        self.kv.release(req)
        req.status = RequestStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)
        self.new_token_ratio = self.cfg.init_new_token_ratio

    # --- results -----------------------------------------------------------------------------
    def on_step_done(self, batch: StepBatch, sampled: list[SampledToken | list[SampledToken]],
                     elapsed_s: float | None = None) -> list[tuple[Request, SampledToken | list[SampledToken]]]:
        """Record a finished forward pass. `sampled` has one entry per sampling sequence, in order:
        a token, or for a sequence with drafts the tokens it emits (accepted drafts plus one).
        `elapsed_s`: the pass's own time when it ran beside other work (overlap); by default the
        time since the step was scheduled."""
        decode_rows = sum(1 for s in batch.seqs if s.decode)
        if elapsed_s is None:
            elapsed_s = perf_counter() - batch.scheduled_at
        self.cost.observe(batch.num_tokens - decode_rows, decode_rows, elapsed_s)
        out = []
        it = iter(sampled)
        for seq in batch.seqs:
            if not seq.sample:
                continue
            tok = next(it)
            req = seq.req
            if req.finished:
                continue  # ended while the step ran (abort, or a stop in the step before): dropped
            req.num_inflight -= 1
            if isinstance(tok, list):
                # Verified drafts (engine/spec/, never with overlap): KV is kept for the last token
                # and the accepted drafts; pages past what the next step needs go back.
                req.num_computed = seq.prefix_len + len(tok)
                req.output_ids.extend(t.token_id for t in tok)
                self.kv.shrink(req, len(req.all_ids))
            else:
                req.output_ids.append(tok.token_id)
            out.append((req, tok))
        return out

    # --- hand-offs to the roles (they read and change the queues only through these) ----------
    def stats(self) -> SchedulerStats:
        kv = self.kv
        return SchedulerStats(
            waiting=len(self.waiting), prefilling=len(self.prefilling), running=len(self.running),
            prefill_tokens=tokens_to_prefill(self.prefilling, self.waiting),
            free_pages=kv.available_pages, total_pages=kv.num_pages, free_slots=kv.slots.num_free_slots)

    def prefill_queue(self, now: float) -> list[tuple[Request, int]]:
        """The prompts being prefilled or waiting, in the order they are offered the prefill budget
        at `now`, each with the tokens it still has to compute (as `tokens_to_prefill` counts them)."""
        prefilling = set(map(id, self.prefilling))
        return [(r, tokens_to_prefill([r], ()) if id(r) in prefilling else tokens_to_prefill((), [r]))
                for r in self.prefill_order.order(self.prefilling, self.waiting, self.policy, now)]

    def new_queue(self) -> PolicyQueue:
        """An empty queue that orders like the waiting queue (a decode worker's prealloc queue)."""
        return PolicyQueue(self.policy)

    def reserve(self, req: Request, pending: Iterable[Request] = ()) -> bool:
        """Give a request outside the queues a slot and pages for its whole prompt, reusing this
        worker's prefix cache, if `admission_room` allows (a decode worker's room before its KV
        arrives). All-or-nothing; the request later joins with `add_running` or goes with `release`.
        It may come back loading its prefix from the KV tiers (`is_loading`): its `cache_len` is
        final once `poll_loads` has finished that load."""
        pending = list(pending)
        return not self._loras_full(req, pending) and self.admission_room(req, pending) and \
            self.kv.admit(req, req.prompt_ids)

    def poll_loads(self) -> list[Request]:
        """Finish the loads from the KV tiers that are done (never waits; `schedule` does this
        too); returns their requests."""
        return self.kv.poll_loads()

    def is_loading(self, req: Request) -> bool:
        """Whether `req` (admitted or reserved) still waits for its prefix to load from the KV tiers."""
        return self.kv.is_loading(req)

    def release(self, req: Request, token_ids: list[int] | None = None) -> None:
        """Free the slot and pages of a request outside the queues (detached, or reserved); full pages
        of `token_ids` (default: all its tokens) go to the prefix cache. Safe on one holding nothing."""
        self.kv.release(req, token_ids)

    def detach(self, req: Request) -> None:
        """Take a request out of the running batch keeping its pages (a prefill worker's
        finished prompt waits for its KV transfer); the caller later calls `release(req, ...)`."""
        self.running.remove(req)
        req.status = RequestStatus.FINISHED

    def admission_room(self, req: Request, pending: Iterable[Request] = ()) -> bool:
        """Whether admitting `req` now keeps the pages reserved for the running batch and for
        `pending` requests (a decode worker's rooms still receiving KV), as prefill admission does."""
        pending = list(pending)
        need = pages_for(len(req.all_ids), self.cfg.page_size)
        reserve = self._reserved_pages([*self.running, *self.prefilling, *pending, req])
        busy = self.running or self.prefilling or pending
        return not busy or need + reserve <= self.kv.available_pages

    def add_running(self, req: Request) -> None:
        """Join a request whose prompt KV is already in its pages (received from a prefill worker)
        and whose first token is known; it decodes from the next step on."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request (stop condition met, or aborted) and free everything it holds."""
        if req.finished:
            return
        for queue in (self.running, self.prefilling):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def check_idle(self) -> None:
        assert not self.has_work(), "check_idle called with requests in flight"
        self.kv.check_idle()
