"""The public `tandem.v1.Generation` service: pair, call, relay, retry.

One request, disaggregated: pick (P, D) by policy, draw a random 63-bit bootstrap room, call
`P.Prefill` and `D.Decode` concurrently and relay D's stream to the client. A failure of either call
cancels the other; a client cancel cancels both. Before the first chunk reaches the client, an
UNAVAILABLE worker (gone) is retried once on another pair; after it, the stream is migrated: continued
on another pair from the tokens already sent (migration.py), up to --max-migrations times.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable, Sequence

import grpc

from tandem.engine.errors import ModelNotFound, TandemError
from tandem.engine.scheduler.queue_policy import QueuePolicy
from tandem.services.common import tracing
from tandem.services.common.grpc_errors import (
    PARAM_METADATA_KEY,
    abort,
    abort_with,
    failed_worker_from_metadata,
    status_for,
)
from tandem.services.common.registry import ROLE_NAMES, WorkerRegistry
from tandem.services.router.admission import Admission
from tandem.services.router.breaker import Breakers
from tandem.services.router.cache_view import PromptKey
from tandem.services.router.channels import ChannelPool
from tandem.services.router.config import RouterConfig
from tandem.services.router.kv_feed import EventPrefixView
from tandem.services.router.lora_routing import adapter_of, served_adapters
from tandem.services.router.metrics import RouterMetrics
from tandem.services.router.migration import StreamLedger
from tandem.services.router.planner import RoutePlan, RoutePlanner, prompt_key
from tandem.services.router.validation import validate_request
from tandem.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# After D's stream ended, how long P may take to report the transfer it already completed.
PREFILL_GRACE_S = 2.0
# Statuses whose worker message is about the caller's request: relayed verbatim, not prefixed.
_CALLER_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.OUT_OF_RANGE}


# Why a stream that broke after tokens were sent was not migrated (metric outcome -> message).
_NOT_MIGRATED = {
    "exhausted": "--max-migrations {n} reached",
    "unsupported": "max_tokens already produced",
    "deadline": "the request's deadline passed",
    "no_worker": "no other worker to continue on",
}


class RouteError(Exception):
    """A request failed; carries the status the client gets and the worker that caused it (if any)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        worker_id: str = "",
        trailing: Sequence[tuple[str, str]] = (),
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.worker_id = worker_id
        self.trailing = tuple(trailing)

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError, stage: str, worker: worker_pb2.WorkerInfo) -> RouteError:
        code, details = err.code(), err.details() or err.code().name
        message = details if code in _CALLER_CODES else f"{stage} worker {worker.worker_id} ({worker.grpc_addr}): {details}"
        trailing = [(k, v) for k, v in err.trailing_metadata() or () if k == PARAM_METADATA_KEY]
        # A decode worker may name the prefill worker its failure is due to: that one is blamed.
        culprit = failed_worker_from_metadata(err.trailing_metadata()) or worker.worker_id
        return cls(code, message, culprit, trailing)


class _Relay:
    """Writes worker chunks to the client; remembers what was sent (migrated, not retried, after that).
    Measures what the client sees: TTFT, the gaps between later tokens (ITL), and once the final
    chunk went out the request's prompt and output lengths."""

    def __init__(self, context: grpc.aio.ServicerContext, started: float, metrics: RouterMetrics,
                 ledger: StreamLedger, on_first: Callable[[], None] = lambda: None):
        self.context = context
        self.started = started
        self.metrics = metrics
        self.ledger = ledger
        self.on_first = on_first  # the prompt was prefilled (the planner stops counting it as queued)
        self.sent = 0
        self._last_token = 0.0  # when the last chunk with tokens went out

    async def send(self, msg: generation_pb2.GenerateResponse) -> None:
        now = time.monotonic()
        if self.sent == 0:
            self.metrics.ttft.observe(now - self.started)
            self.on_first()
        elif msg.token_ids:
            self.metrics.observe_itl(now - self._last_token, len(msg.token_ids))
        if msg.token_ids or self.sent == 0:
            self._last_token = now
        self.sent += 1
        await self.context.write(self.ledger.record(msg))
        if self.ledger.finished:
            request = self.ledger.request
            prompt = msg.usage.prompt_tokens if msg.HasField("usage") else len(request.token_ids.ids)
            self.metrics.prompt_tokens.observe(prompt)
            self.metrics.output_tokens.observe(len(self.ledger.sent_ids))


def _discard(task: asyncio.Future | None) -> None:
    """Cancel a helper task and make sure its outcome is retrieved (no 'never retrieved' warnings)."""
    if task is None:
        return
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, channels: ChannelPool, metrics: RouterMetrics,
                 kv_view: EventPrefixView | None = None):
        """`kv_view`: the workers' KV events (Redis registry only), which the planner asks first."""
        self.config = config
        self.registry = registry
        self.channels = channels
        self.metrics = metrics
        self.planner = RoutePlanner(config.policy, config.route, config.roles,
                                    on_route=metrics.count_route, on_reuse=metrics.count_reuse, exact=kv_view)
        self.admission = Admission(config.max_inflight, config.max_queued_requests, QueuePolicy(
            config.enable_priority_scheduling, config.low_priority_values_first), config.queue_timeout_s,
            on_shed=metrics.shed.inc)
        metrics.queued.set_function(lambda: len(self.admission.queue))
        self.breakers = Breakers(config.cb_failure_threshold, config.cb_timeout_s) if config.circuit_breaker else None
        metrics.watch_workers(registry.all_workers)  # their announced loads, for the planner

    # ---- public RPCs -------------------------------------------------------------------------

    async def ListModels(self, request, context):
        models: dict[str, generation_pb2.ModelInfo] = {}
        for role in self.config.roles:
            for w in self.registry.workers(role):
                if not w.model:
                    continue
                for name, parent in ((w.model, ""), *((a, w.model) for a in served_adapters(w))):
                    m = models.setdefault(name, generation_pb2.ModelInfo(id=name, vocab_size=w.vocab_size, parent=parent))
                    if w.max_context_len and (not m.max_context_len or w.max_context_len < m.max_context_len):
                        m.max_context_len = w.max_context_len  # the smallest: what every worker can take
        return generation_pb2.ListModelsResponse(models=[models[k] for k in sorted(models)])

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    async def Generate(self, request, context):
        started = time.monotonic()
        self.metrics.arrivals.inc()
        try:
            validate_request(request, self.config.limits)  # before queueing: a bad request never waits
            # Queued by priority then deadline; shed (RESOURCE_EXHAUSTED) once it cannot start in time.
            await self.admission.acquire(request.priority, self._deadline(context, started), started)
        except TandemError as e:
            self.metrics.requests.labels(status_for(e).name.lower()).inc()
            log.info("[%s] rejected: %s", request.request_id, e)
            await abort_with(context, e)
        rid = request.request_id or uuid.uuid4().hex
        self.metrics.inflight.inc()
        status = "unknown"
        span = tracing.start("router.generate", tracing.extract(context.invocation_metadata()), server=True,
                             start_s=started, attributes={"tandem.request_id": rid,
                                                          "gen_ai.request.model": request.model})
        tracing.record("router.queue", span, started, time.monotonic(), {"tandem.priority": request.priority})
        try:
            with tracing.current(span):
                sent = await self._route(request, rid, context, self._deadline(context, started), started)
            status = "ok"
            log.debug("[%s] done: %d chunks in %.3f s", rid, sent, time.monotonic() - started)
        except TandemError as e:
            status = status_for(e).name.lower()
            log.info("[%s] rejected: %s", rid, e)
            await abort_with(context, e)
        except RouteError as e:
            status = e.code.name.lower()
            log.warning("[%s] failed (%s): %s", rid, e.code.name, e.message)
            await abort(context, e.code, e.message, e.trailing)
        except asyncio.CancelledError:
            status = "cancelled"
            log.info("[%s] cancelled by the client after %.3f s", rid, time.monotonic() - started)
            raise
        except Exception as e:
            status = "internal"
            log.exception("[%s] router error", rid)
            await abort(context, grpc.StatusCode.INTERNAL, f"router error: {type(e).__name__}: {e}")
        finally:
            self.admission.release()
            self.metrics.inflight.dec()
            self.metrics.requests.labels(status).inc()
            tracing.end(span, {"tandem.status": status}, error=None if status == "ok" else status)

    # ---- routing -----------------------------------------------------------------------------

    def _deadline(self, context: grpc.aio.ServicerContext, started: float) -> float | None:
        limits = [self.config.request_timeout_s] if self.config.request_timeout_s > 0 else []
        remaining = context.time_remaining()
        if remaining is not None:
            limits.append(remaining)
        return started + min(limits) if limits else None

    def _candidates(self, role: int, model: str, exclude: set[str]) -> list[worker_pb2.WorkerInfo]:
        workers = self.registry.workers(role)
        name = ROLE_NAMES[role]
        if not workers:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, f"no {name} workers are registered")
        if model:
            workers = [w for w in workers if not w.model or w.model == model or model in served_adapters(w)]
            if not workers:
                served = sorted({m for w in self.registry.workers(role) for m in (w.model, *served_adapters(w))})
                raise ModelNotFound(f"model {model!r} is not served; available: {', '.join(served)}")
        return [w for w in workers if w.worker_id not in exclude]

    def _pick(self, model: str, key: PromptKey, failed: set[str], avoid: set[str]) -> RoutePlan:
        """Workers for every role of the mode (planner.py), never a failed one, preferably not one in `avoid`."""
        usable = {}
        fallback = None
        for role in self.config.roles:
            if role == worker_pb2.WORKER_ROLE_PREFILL and self.config.min_prefill_workers == 0:
                usable[role] = self._optional_prefill(model, failed, avoid)
                continue
            try:
                candidates = self._candidates(role, model, failed | avoid) or self._candidates(role, model, failed)
                if not candidates:
                    raise RouteError(grpc.StatusCode.UNAVAILABLE, f"no other {ROLE_NAMES[role]} worker to retry on")
            except RouteError as e:
                fallback = self._fallback(role, key, e.message)
                usable[role] = []
                continue
            if self.breakers is not None:
                healthy = [w for w in candidates if not self.breakers.is_open(w)]
                if not healthy and role == worker_pb2.WORKER_ROLE_PREFILL and self._may_fall_back(key):
                    fallback = self._fallback(role, key, "every prefill worker's circuit is open")
                    usable[role] = []
                    continue
                candidates = healthy or candidates
            usable[role] = candidates
        plan = self.planner.plan(key, usable)
        if fallback is not None:
            plan.fallback = fallback
            self.metrics.fallbacks.labels(fallback).inc()
        return plan

    def _may_fall_back(self, key: PromptKey) -> bool:
        """A prompt no prefill worker can take may be prefilled by its decode worker (decode-only fallback)."""
        route = self.config.route
        limit = route.fallback_local_prefill_max_tokens
        return self.config.mode != "colocated" and route.fallback and (limit < 0 or key.num_tokens <= limit)

    def _fallback(self, role: int, key: PromptKey, why: str) -> str:
        """The reason a plan falls back to the decode worker's own prefill, or raises why it cannot."""
        route = self.config.route
        if role != worker_pb2.WORKER_ROLE_PREFILL:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, why)
        if not route.fallback:
            raise RouteError(grpc.StatusCode.UNAVAILABLE, f"{why} (--no-fallback: decode workers do not prefill instead)")
        if not self._may_fall_back(key):
            raise RouteError(grpc.StatusCode.UNAVAILABLE,
                             f"{why}, and the prompt's {key.num_tokens} tokens exceed "
                             f"--fallback-local-prefill-max-tokens {route.fallback_local_prefill_max_tokens} "
                             "for a decode worker to prefill it")
        return "no_prefill_worker" if "circuit" not in why else "circuits_open"

    def _optional_prefill(self, model: str, failed: set[str], avoid: set[str]) -> list[worker_pb2.WorkerInfo]:
        """--min-prefill-workers 0: the usable prefill workers, possibly none (the decode worker then
        prefills the prompt itself; the decode role still answers for a model nobody serves)."""
        try:
            candidates = (self._candidates(worker_pb2.WORKER_ROLE_PREFILL, model, failed | avoid)
                          or self._candidates(worker_pb2.WORKER_ROLE_PREFILL, model, failed))
        except (RouteError, ModelNotFound):
            return []
        return self.breakers.healthy(candidates) if self.breakers is not None and candidates else candidates

    async def _route(self, request, rid: str, context, deadline: float | None, started: float) -> int:
        failed: set[str] = set()
        key = prompt_key(request, adapter_of(request.model, self.registry.all_workers()))
        plan = self._pick(request.model, key, failed, set())
        ledger = StreamLedger(request, self.config.max_migrations)
        relay = _Relay(context, started, self.metrics, ledger, on_first=lambda: self.planner.first_token(plan))
        attempt = 0
        sent_request = request  # the original, or the continuation after a migration
        while True:
            current = plan
            self.planner.begin(current)
            attrs = self._trace_plan(current, attempt)
            if attrs is not None and ledger.migrations:
                attrs.update({"tandem.migration": ledger.migrations, "tandem.migration.resumed_tokens": ledger.resumed})
            span = tracing.start("router.attempt", attributes=attrs)
            try:
                with tracing.current(span):   # the worker calls carry it
                    if self.config.mode == "colocated":
                        await self._colocated(sent_request, rid, current.decode, relay, deadline)
                    else:
                        await self._disagg(sent_request, rid, current.prefill, current.decode, relay, deadline,
                                           current.reuse_decode_kv)
                self._outcome(current, None)
                return relay.sent
            except RouteError as e:
                tracing.end(span, {"tandem.error_worker": e.worker_id or ""}, error=f"{e.code.name}: {e.message}")
                span = None
                self._outcome(current, e)
                if ledger.finished:  # the final chunk went out; only the stream's end was lost
                    log.info("[%s] %s after the final chunk", rid, e.message)
                    return relay.sent
                if relay.sent:
                    plan = self._migrate(rid, e, ledger, request, key, failed, current, deadline)
                    sent_request = ledger.continuation()
                    attempt += 1
                    self.metrics.migrations.labels("migrated").inc()
                    log.warning("[%s] %s; migrating after %d tokens to %s (migration %d of at most %d)", rid,
                                e.message, len(ledger.sent_ids), ", ".join(w.worker_id for w in plan.workers),
                                ledger.migrations, ledger.max_migrations)
                    continue
                retry = (
                    e.code == grpc.StatusCode.UNAVAILABLE and e.worker_id and relay.sent == 0
                    and attempt < self.config.max_retries and (deadline is None or time.monotonic() < deadline)
                )
                if not retry:
                    raise
                failed.add(e.worker_id)
                try:  # never the worker that failed, preferably neither of the pair
                    plan = self._pick(request.model, key, failed, {w.worker_id for w in current.workers})
                except RouteError:
                    raise e from None  # nothing else to try: report the real failure
                attempt += 1
                self.metrics.retries.inc()
                log.warning("[%s] %s; retrying on %s", rid, e.message, ", ".join(w.worker_id for w in plan.workers))
            finally:
                tracing.end(span)
                self.planner.end(current, ledger.sent_ids)

    def _trace_plan(self, plan: RoutePlan, attempt: int) -> dict | None:
        """The policy decision as span attributes (None, and nothing computed, when tracing is off)."""
        if not tracing.enabled():
            return None
        p = plan.prefill
        return {"tandem.route.policy": self.config.policy, "tandem.route": plan.route, "tandem.attempt": attempt,
                "tandem.route.fallback": plan.fallback or "",
                "tandem.route.prefill_worker": p.worker_id if p is not None else "",
                "tandem.route.decode_worker": plan.decode.worker_id,
                "tandem.route.prefill_tokens": plan.prefill_tokens,
                # Each worker weighed: role, id, tokens it would compute before this first token
                # (queued + uncached), tokens of the prompt it holds, requests in flight on it.
                "tandem.route.candidates": [
                    f"{ROLE_NAMES.get(c.info.role, '?')}:{c.worker_id} cost={c.prefill_cost} cached={c.cached_tokens} "
                    f"inflight={c.inflight}" for c in plan.considered]}

    def _migrate(self, rid: str, e: RouteError, ledger: StreamLedger, request, key: PromptKey, failed: set[str],
                 current: RoutePlan, deadline: float | None) -> RoutePlan:
        """The pair to continue a stream that broke after tokens were sent, or raise `e` saying why not."""
        why = ledger.why_not(e.code, request.sampling.max_tokens or None) if e.worker_id else "not_migratable"
        if why is None and deadline is not None and time.monotonic() >= deadline:
            why = "deadline"
        if why is None:
            failed.add(e.worker_id)
            try:  # never the worker that failed, preferably neither of the pair
                return self._pick(request.model, key, failed, {w.worker_id for w in current.workers})
            except RouteError:
                why = "no_worker"
        if why != "not_migratable":
            self.metrics.migrations.labels(why).inc()
            e.message += (f" (the stream broke after {len(ledger.sent_ids)} tokens and was not continued: "
                          f"{_NOT_MIGRATED[why].format(n=ledger.max_migrations)})")
            log.warning("[%s] not migrated (%s)", rid, why)
        raise e

    def _outcome(self, plan: RoutePlan, err: RouteError | None) -> None:
        """Feed the circuit breakers: a worker that answered UNAVAILABLE failed; a finished pair worked."""
        if self.breakers is None:
            return
        for w in plan.workers:
            if err is None:
                self.breakers.on_success(w)
            elif err.code == grpc.StatusCode.UNAVAILABLE and err.worker_id == w.worker_id:
                self.breakers.on_failure(w, err.message)
        self.metrics.open_circuits.set(self.breakers.open_count())

    @staticmethod
    def _timeout(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    async def _disagg(self, request, rid, p: worker_pb2.WorkerInfo | None, d: worker_pb2.WorkerInfo, relay: _Relay,
                      deadline, reuse: bool = False):
        """`p` None: D prefills the prompt itself (conditional disaggregation), no room is handed over.
        `reuse`: P fetches what D holds of the prompt beyond its own cache (RoutePlan.reuse_decode_kv)."""
        room = secrets.randbits(63)
        prompt = {"token_ids": request.token_ids} if request.HasField("token_ids") else {"text": request.text}
        lora = request.model if request.model in served_adapters(d) else ""   # applied on both (P checks D's)
        log.info("[%s] prefill=%s decode=%s room=%d", rid, p.worker_id if p else "local", d.worker_id, room)
        timeout = self._timeout(deadline)
        prefill_call = None
        if p is not None:
            prefill_call = worker_pb2_grpc.PrefillWorkerStub(self.channels.get(p.grpc_addr)).Prefill(
                worker_pb2.PrefillRequest(request_id=rid, bootstrap_room=room, sampling=request.sampling, lora=lora,
                                          priority=request.priority, resume_ids=request.resume_ids,
                                          reuse_decode_kv=reuse, **prompt),
                timeout=timeout, metadata=tracing.outgoing(),
            )
            peer = {"prefill_bootstrap_addr": p.bootstrap_addr, "prefill_worker_id": p.worker_id,
                    "prefill_boot_epoch": p.boot_epoch}
        else:
            peer = {"local_prefill": True}
        decode_call = worker_pb2_grpc.DecodeWorkerStub(self.channels.get(d.grpc_addr)).Decode(
            worker_pb2.DecodeRequest(request_id=rid, bootstrap_room=room, sampling=request.sampling, lora=lora,
                                     priority=request.priority, resume_ids=request.resume_ids, **prompt, **peer),
            timeout=timeout, metadata=tracing.outgoing(),
        )
        prefill_done = asyncio.ensure_future(self._await_prefill(prefill_call, p, room))
        read: asyncio.Future | None = None
        streaming = False        # D relayed a token: the KV reached it, P's answer no longer decides
        try:
            while True:
                try:
                    if streaming or prefill_done.done():  # the common case once the KV arrived: a plain read
                        msg = await decode_call.read()
                    else:  # race the next chunk against P's answer, so a failed prefill fails fast
                        read = asyncio.ensure_future(decode_call.read())
                        await asyncio.wait((read, prefill_done), return_when=asyncio.FIRST_COMPLETED)
                        if prefill_done.done() and (err := prefill_done.result()) is not None:
                            raise err
                        msg, read = await read, None
                except grpc.aio.AioRpcError as e:
                    raise RouteError.from_rpc(e, "decode", d) from None
                if msg is grpc.aio.EOF:
                    break
                await relay.send(msg)
                streaming = True
            # D finished: the KV reached it, so P's answer is due any moment. The client already has
            # every token; a late or failed answer is only worth a log line.
            done, _ = await asyncio.wait((prefill_done,), timeout=PREFILL_GRACE_S)
            err = prefill_done.result() if done else None
            if not done:
                log.warning("[%s] prefill %s did not answer after decode finished", rid, p.worker_id)
            elif err is not None:
                log.warning("[%s] decode finished but %s", rid, err.message)
        finally:
            # No-ops for calls that already finished; otherwise the worker sees the cancellation.
            decode_call.cancel()
            if prefill_call is not None:
                prefill_call.cancel()
            _discard(read)
            _discard(prefill_done)

    @staticmethod
    async def _await_prefill(call, p: worker_pb2.WorkerInfo, room: int) -> RouteError | None:
        """The prefill call's outcome as an error to raise, or None when the room's KV was delivered
        (always None for a local prefill: no call)."""
        if call is None:
            return None
        try:
            resp = await call
        except grpc.aio.AioRpcError as e:
            return RouteError.from_rpc(e, "prefill", p)
        if resp.state == worker_pb2.TRANSFER_STATE_SUCCESS:
            return None
        state = worker_pb2.TransferState.Name(resp.state)
        # A failed room is a failed hand-off (peer gone, timeout, transfer error), not a bug in the
        # request: UNAVAILABLE, which the client (or the router, before the first token) may retry.
        return RouteError(
            grpc.StatusCode.UNAVAILABLE,
            f"prefill worker {p.worker_id} ({p.grpc_addr}) failed room {room} ({state}): {resp.error or 'no reason given'}",
            p.worker_id,
        )

    async def _colocated(self, request, rid, w: worker_pb2.WorkerInfo, relay: _Relay, deadline):
        log.info("[%s] colocated=%s", rid, w.worker_id)
        forwarded = generation_pb2.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.request_id = rid
        call = generation_pb2_grpc.GenerationStub(self.channels.get(w.grpc_addr)).Generate(
            forwarded, timeout=self._timeout(deadline), metadata=tracing.outgoing()
        )
        try:
            while True:
                try:
                    msg = await call.read()
                except grpc.aio.AioRpcError as e:
                    raise RouteError.from_rpc(e, "colocated", w) from None
                if msg is grpc.aio.EOF:
                    return
                await relay.send(msg)
        finally:
            call.cancel()
