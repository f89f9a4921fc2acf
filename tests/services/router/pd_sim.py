"""A 1P1D deployment on a simulated clock, routed by the real `RoutePlanner` (test support, torch-free).

What it is for: replaying one arrival trace at several rates and reading off the share of requests
within the SLO, so that a routing rule whose capacity is not monotonic in load (a lower rate doing
worse than a higher one) fails a unit test instead of a 20-minute benchmark.

What is modelled, and what is not:
- Arrivals: one list of Poisson gaps (mean 1 s) replayed at `rate` by scaling it by 1/rate.
- The router: the real planner (`plan` / `begin` / `first_token` / `end`, its in-flight accounting),
  seeing the workers' `WorkerInfo` as the Redis registry delivers it: each worker samples its load
  every `heartbeat_s` (services/worker/config.py `heartbeat_s`, 1.0 s; its `_report_load` period and
  the registry heartbeat), the router's watch polls every `poll_s` (RedisRegistry `poll_s`, 0.5 s).
  The real view is older still (sampling and writing are two loops), never fresher.
- P, the prefill worker: engine steps of at most `chunk_tokens` prompt tokens taken in arrival
  order (equal prompts: what shortest-first amounts to), each `base + per_token * tokens`; a prompt
  finished in a step reaches D `transfer_s` later.
- D, the decode worker: steps back to back while it has work. A step carries one token of every
  running request and, with mixed chunks, part of its local prefills: the engine's budget (engine/
  scheduler/step_cost.py `prefill_budget`: the step at most `itl_factor` decode steps, never under a
  page) or, when larger, what keeps queued prompts within `ttft_target_s` (engine/scheduler/
  scheduler.py `_ttft_budget`), both on the fitted costs, which here are the true ones. With nothing
  running a step prefills up to `chunk_tokens`. KV that arrived joins at the next step boundary,
  where its first token (P's) goes out, as D's engine thread polls the receiver between steps.
- Reports: D's `running` counts its decoding requests and the remote rooms it awaits KV for (as
  services/decode/worker.py `load` does); `prefill_tokens` the prompt tokens still to compute; the
  step-cost fit is the true costs (steps > 0).
- Not modelled: step-time noise, the gateway and network hops, memory limits (pages never run
  out), prefix-cache hits (every prompt is distinct), the fit's lag behind the true costs, other
  routers. A step's tokens are booked when it is scheduled, as the engine commits them.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.services.router.cache_view import PromptKey
from tandem.services.router.planner import RoutePlan, RoutePlanner
from tandem.services.router.route_config import RouteConfig
from tandem.v1 import worker_pb2

P, D = worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE


@dataclass(frozen=True)
class StepCosts:
    """A worker's step time: base_s + per_decode_row_s * rows + per_prefill_token_s * tokens."""

    base_s: float
    per_decode_row_s: float
    per_prefill_token_s: float

    def step_s(self, rows: int, tokens: int) -> float:
        return self.base_s + self.per_decode_row_s * rows + self.per_prefill_token_s * tokens


# SmolLM2-135M fp32, one AVX2 core per worker, on a 2-core box shared with the load generator,
# gateway and router (the issue [25] runs). Sources: docs/benchmarks.md, docs/benchmarks-history.md.
# - P: 40 ms + 2.5 ms per prompt token, a 256-token prompt in 0.68 s: the prefill worker's ~400 tok/s
#   during the AVX2 1P1D runs ("`make run`'s defaults on an AVX2-only CPU"); the base is D's.
# - D, a decode step: 40 ms + 4 ms per row. One thread decodes 8 rows in 40 ms on an idle box ("Dtype
#   choice per CPU": 200 tok/s) and about 2x slower beside the rest of the stack (the same step 46 ms
#   against 23 ms alone: "What any schedule can reach here"): 72 ms at 8 rows.
# - D, a mixed chunk's prompt token: 3.8 ms, 1.5x P's whole-prompt token (prompt tokens cost more in
#   short chunks than in whole prompts, "What any schedule can reach here": 2.3 against 0.93 ms on the
#   2-thread engine). With the step costs above it is what fits both ends of what D showed at 1-1.5
#   req/s in the issue [25] runs: 160 ms steps at 15 rows and ~100 prompt tok/s (16 tokens a step),
#   370 ms at 26 rows and ~158 tok/s (58 tokens a step).
AVX2_DECODE = StepCosts(base_s=0.040, per_decode_row_s=0.004, per_prefill_token_s=0.0038)
AVX2_PREFILL = StepCosts(base_s=0.040, per_decode_row_s=0.0, per_prefill_token_s=0.0025)


@dataclass(frozen=True)
class SimConfig:
    decode: StepCosts = AVX2_DECODE
    prefill: StepCosts = AVX2_PREFILL
    transfer_s: float = 0.02       # KV of 256 fp32 tokens (~12 MB) over shm, mostly streamed during the forward
    prompt_tokens: int = 256
    output_tokens: int = 64
    itl_factor: float = 1.5        # EngineConfig.mixed_chunk_itl_factor
    ttft_target_s: float = 1.5     # EngineConfig.mixed_chunk_ttft_target_s
    page_size: int = 16            # EngineConfig.page_size: the least chunk a mixed step carries
    chunk_tokens: int = 2048       # EngineConfig.chunked_prefill_size
    heartbeat_s: float = 1.0       # WorkerConfig.heartbeat_s
    poll_s: float = 0.5            # RedisRegistry.poll_s


@dataclass
class Outcome:
    arrival: float
    route: str
    first: float = math.nan        # first token out
    last: float = math.nan         # last token out

    @property
    def ttft_s(self) -> float:
        return self.first - self.arrival


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.150

    def met(self, o: Outcome, output_tokens: int) -> bool:
        tpot = (o.last - o.first) / (output_tokens - 1)
        return o.ttft_s <= self.ttft_s and tpot <= self.tpot_s


def poisson_gaps(n: int, seed: int) -> list[float]:
    """Inter-arrival gaps of a Poisson process of rate 1: the trace every rate replays."""
    rng = random.Random(seed)
    return [rng.expovariate(1.0) for _ in range(n)]


def distinct_keys(n: int, tokens: int) -> list[PromptKey]:
    """`n` prompts sharing no prefix block (built once; the planner only reads them)."""
    return [PromptKey.of(token_ids=range(i * tokens, (i + 1) * tokens)) for i in range(n)]


@dataclass(eq=False)
class _Req:
    out: Outcome
    key: PromptKey
    left: int                      # prompt tokens not yet scheduled on the worker that prefills it
    plan: RoutePlan | None = None


@dataclass
class _Worker:
    worker_id: str
    costs: StepCosts
    queue: deque = field(default_factory=deque)      # prompts to prefill, in order (P's, or D's local ones)
    busy_until: float | None = None                  # the end of the step in flight


class Sim:
    """One replay: `run()` routes every arrival, runs both workers to the end and returns the outcomes."""

    def __init__(self, arrivals: Sequence[float], keys: Sequence[PromptKey], route: RouteConfig,
                 cfg: SimConfig = SimConfig()):
        self.cfg = cfg
        self.planner = RoutePlanner("cache_aware", route, (P, D))
        self.p = _Worker("p0", cfg.prefill)
        self.d = _Worker("d0", cfg.decode)
        self.reqs = [_Req(Outcome(t, ""), k, cfg.prompt_tokens) for t, k in zip(arrivals, keys, strict=True)]
        self.events: list = []
        self._seq = itertools.count()
        # D: requests decoding (by the step count at which they finish), KV that arrived, rooms awaited.
        self.steps = 0
        self.finishing: dict[int, list[_Req]] = {}
        self.running = 0
        self.arrived: list[_Req] = []
        self.awaiting = 0
        self.finished = 0
        self.sampled = {w.worker_id: self._info(w) for w in (self.p, self.d)}
        self.view = dict(self.sampled)

    # ---- the event loop ---------------------------------------------------------------------
    def run(self) -> list[Outcome]:
        for r in self.reqs:
            self._at(r.out.arrival, self._arrive, r)
        self._at(0.0, self._beat)
        self._at(self.cfg.poll_s / 2, self._poll)
        while self.finished < len(self.reqs):
            t, _, fn, arg = heapq.heappop(self.events)
            fn(t, arg)
        assert not self.planner.inflight and not self.planner.inflight_tokens
        return [r.out for r in self.reqs]

    def _at(self, t: float, fn, arg=None) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn, arg))

    def _beat(self, now: float, _) -> None:
        self.sampled = {w.worker_id: self._info(w) for w in (self.p, self.d)}
        self._at(now + self.cfg.heartbeat_s, self._beat)

    def _poll(self, now: float, _) -> None:
        self.view = dict(self.sampled)
        self._at(now + self.cfg.poll_s, self._poll)

    def _info(self, w: _Worker) -> worker_pb2.WorkerInfo:
        queued = sum(r.left for r in w.queue)
        if w is self.d:
            load = worker_pb2.WorkerLoad(running=self.running + self.awaiting, waiting=sum(
                r.left == self.cfg.prompt_tokens for r in w.queue), prefill_tokens=queued)
        else:
            load = worker_pb2.WorkerLoad(running=int(w.busy_until is not None), waiting=len(w.queue),
                                         prefill_tokens=queued)
        load.free_pages = load.total_pages = 1 << 20
        c = w.costs
        load.step_cost.CopyFrom(worker_pb2.StepCost(base_s=c.base_s, per_decode_row_s=c.per_decode_row_s,
                                                    per_prefill_token_s=c.per_prefill_token_s, steps=100))
        role = D if w is self.d else P
        return worker_pb2.WorkerInfo(worker_id=w.worker_id, role=role, load=load)

    # ---- the router -------------------------------------------------------------------------
    def _arrive(self, now: float, r: _Req) -> None:
        r.plan = self.planner.plan(r.key, {P: [self.view["p0"]], D: [self.view["d0"]]})
        self.planner.begin(r.plan)
        r.out.route = r.plan.route
        if r.plan.route == "remote":
            self.awaiting += 1
            self.p.queue.append(r)
            self._kick(self.p, now)
        else:
            self.d.queue.append(r)
            self._kick(self.d, now)

    def _first_token(self, now: float, r: _Req) -> None:
        r.out.first = now
        self.planner.first_token(r.plan)
        self.finishing.setdefault(self.steps + self.cfg.output_tokens - 1, []).append(r)
        self.running += 1

    # ---- P ----------------------------------------------------------------------------------
    def _kick(self, w: _Worker, now: float) -> None:
        if w.busy_until is None:
            (self._d_step if w is self.d else self._p_step)(now)

    def _take(self, w: _Worker, budget: int) -> tuple[int, list[_Req]]:
        """Schedule up to `budget` prompt tokens from the front of `w`'s queue: the tokens taken and
        the prompts whose last chunk they include (they leave the queue)."""
        taken, done = 0, []
        for r in w.queue:
            if taken >= budget:
                break
            n = min(r.left, budget - taken)
            r.left -= n
            taken += n
            if not r.left:
                done.append(r)
        for _ in done:
            w.queue.popleft()
        return taken, done

    def _p_step(self, now: float) -> None:
        if not self.p.queue:
            self.p.busy_until = None
            return
        tokens, done = self._take(self.p, self.cfg.chunk_tokens)
        self.p.busy_until = now + self.p.costs.step_s(0, tokens)
        self._at(self.p.busy_until, self._p_done, done)

    def _p_done(self, now: float, done: list[_Req]) -> None:
        for r in done:
            self._at(now + self.cfg.transfer_s, self._kv_arrives, r)
        self._p_step(now)

    def _kv_arrives(self, now: float, r: _Req) -> None:
        self.arrived.append(r)
        self._kick(self.d, now)

    # ---- D ----------------------------------------------------------------------------------
    def _d_step(self, now: float) -> None:
        for r in self.arrived:
            self.awaiting -= 1
            self._first_token(now, r)
        self.arrived.clear()
        if not self.running and not self.d.queue:
            self.d.busy_until = None
            return
        rows = self.running
        tokens, done = self._take(self.d, self._d_budget(now, rows) if rows else self.cfg.chunk_tokens)
        self.d.busy_until = now + self.d.costs.step_s(rows, tokens)
        self._at(self.d.busy_until, self._d_done, done)

    def _d_budget(self, now: float, rows: int) -> int:
        """The engine's mixed-step prefill budget on its fitted costs (step_cost.py `prefill_budget`,
        then scheduler.py `_ttft_budget` when that asks for more)."""
        cfg, c = self.cfg, self.d.costs
        decode, cap = c.step_s(rows, 0), cfg.chunk_tokens - rows
        budget = max(cfg.page_size, min(cap, int(round((cfg.itl_factor - 1.0) * decode / c.per_prefill_token_s, 3))))
        if not cfg.ttft_target_s:
            return budget
        need, queued = 0, 0
        for r in self.d.queue:
            queued += r.left
            left = r.out.arrival + cfg.ttft_target_s - now - c.per_prefill_token_s * queued
            need = max(need, queued if left <= decode else math.ceil(queued * decode / left))
        return max(budget, min(cap, need))

    def _d_done(self, now: float, prefilled: list[_Req]) -> None:
        self.steps += 1
        for r in self.finishing.pop(self.steps, []):
            r.out.last = now
            self.running -= 1
            self.finished += 1
            self.planner.end(r.plan)
        for r in prefilled:
            self._first_token(now, r)
        self._d_step(now)


def replay(gaps: Sequence[float], rate: float, route: RouteConfig, cfg: SimConfig = SimConfig(),
           keys: Sequence[PromptKey] | None = None) -> list[Outcome]:
    """The trace `gaps` (mean 1 s) at `rate` requests/s through a fresh 1P1D deployment."""
    arrivals = list(itertools.accumulate(g / rate for g in gaps))
    return Sim(arrivals, keys or distinct_keys(len(gaps), cfg.prompt_tokens), route, cfg).run()


def slo_share(outcomes: Sequence[Outcome], output_tokens: int, slo: Slo = Slo()) -> float:
    return sum(slo.met(o, output_tokens) for o in outcomes) / len(outcomes)
