"""Per request: which workers, and whether the prompt is prefilled remotely or on the decode worker.

Disaggregated mode, in this order (one cost model, services/router/cost.py):
1. The decode worker, by policy.
2. Local prefill when the part of the prompt its prefix cache lacks is at most
   `--local-prefill-max-tokens`, D's running requests keep their inter-token latency within
   `--local-prefill-max-itl-ms` while D prefills it (by D's reported step costs: `itl_with_prefill_s`),
   and D would start it no later than the best prefill worker: such a
   prompt's first token comes sooner from D's own mixed-chunk prefill than through a prefill
   worker's queue, the bootstrap handshake and a transfer. A D that is decoding gives a prefill
   only part of each step (the mixed-chunk bound), so its cost counts `BUSY_DECODE_SLOWDOWN` times:
   under load short prompts then go to an idle prefill worker instead of piling onto D while P
   idles, and stay local when D holds most of the prompt cached or P has a long queue.
3. Otherwise the prefill worker, by policy; but when every prefill worker is saturated (more than
   `--max-prefill-queue-tokens` queued) and D would finish this prompt's prefill sooner
   (`prefill_cost`) within the same latency bound, local after all.
`tandem_router_prefill_route_total{route}` counts the outcomes. The planner also keeps this router's
in-flight accounting per worker (requests, and prompt tokens not yet prefilled) and records every
routed prompt in the router's view of the workers' prefix caches. A LoRA adapter's request is picked
among the workers lora_routing.py prefers for it; its prompt key is under the adapter's key space. Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tandem.services.router.cache_view import PrefixCacheView, PromptKey
from tandem.services.router.cost import Candidate, reuse_tokens
from tandem.services.router.kv_feed import EventPrefixView
from tandem.services.router.lora_routing import adapter_block_parent, lora_affinity
from tandem.services.router.policy import RouteRequest, make_policy
from tandem.services.router.route_config import RouteConfig
from tandem.v1 import worker_pb2

# A decode worker with requests running gives a prefill chunk (F-1)/F of each mixed step, F being its
# --mixed-chunk-itl-factor: at the default 1.5 that is 1/3 of its time, ~3x slower than alone; the
# router does not know F, and 2 errs towards keeping short prompts local.
BUSY_DECODE_SLOWDOWN = 2.0
# The engine's default --mixed-chunk-itl-factor: how much longer than a decode step a mixed step may be.
MIXED_CHUNK_ITL_FACTOR = 1.5

PREFILL, DECODE, COLOCATED = (worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE,
                              worker_pb2.WORKER_ROLE_COLOCATED)


@dataclass(eq=False)
class RoutePlan:
    """Where one attempt of a request goes."""

    workers: tuple[worker_pb2.WorkerInfo, ...]  # every worker it touches: (P, D), (D,) local, (W,) co-located
    route: str                                  # "remote" | "local" | "colocated"
    key: PromptKey
    prefill_tokens: int = 0                     # charged to the prefilling worker until the first token
    first_token: bool = False
    considered: tuple[Candidate, ...] = ()      # every worker weighed, with its costs (the request's trace)
    fallback: str | None = None                 # why a disagg request prefills on D although it wanted P
    reuse_decode_kv: bool = False               # P fetches what D holds of the prompt beyond its cache

    @property
    def prefill(self) -> worker_pb2.WorkerInfo | None:
        return self.workers[0] if self.route == "remote" else None

    @property
    def decode(self) -> worker_pb2.WorkerInfo:
        return self.workers[-1]

    @property
    def prefilling_worker(self) -> str:
        return self.workers[0].worker_id


class RoutePlanner:
    def __init__(self, policy: str, cfg: RouteConfig, roles: Sequence[int], on_route=None,
                 exact: EventPrefixView | None = None, on_reuse=None):
        """`exact`: the workers' KV events (kv_feed.py), asked first; the approximate view answers for
        workers without an exact view and for prompts without token ids."""
        self.cfg = cfg
        self.policies = {role: make_policy(policy, cfg) for role in roles}
        self.cache = PrefixCacheView(ttl_s=cfg.prefix_cache_ttl_s)
        self.exact = exact
        self.on_route = on_route                 # called with "remote" / "local" for every disagg plan
        self.on_reuse = on_reuse                 # called with "fetch" / "compute" when D holds more than P
        self.inflight: Counter[str] = Counter()
        self.inflight_tokens: Counter[str] = Counter()
        self.inflight_adapters: Counter[tuple[str, str]] = Counter()   # (worker, LoRA adapter) -> requests

    def plan(self, key: PromptKey, candidates: Mapping[int, Sequence[worker_pb2.WorkerInfo]]) -> RoutePlan:
        """`candidates`: the usable workers of every role this mode routes to (each non-empty, except
        prefill under --min-prefill-workers 0: none means the local route)."""
        request = RouteRequest(key, key.adapter)
        if COLOCATED in candidates:
            colocated = self._candidates(candidates[COLOCATED], key)
            w = self._pick(COLOCATED, request, colocated)
            return RoutePlan((w.info,), "colocated", key, w.uncached_tokens, considered=tuple(colocated))
        decode = self._candidates(candidates[DECODE], key)
        d = self._pick(DECODE, request, decode)
        prefill = self._candidates(candidates[PREFILL], key)   # built once: each looks up the prefix view
        # No usable prefill worker (--min-prefill-workers 0): D prefills its own prompt.
        route = "local" if not prefill or self._local_sooner(d, prefill) else "remote"
        p = None
        if route == "remote":
            p = self._pick(PREFILL, request, prefill)
            if self._saturated(prefill) and d.prefill_cost < p.prefill_cost and self._keeps_itl(d):
                route = "local"
        if self.on_route is not None:
            self.on_route(route)
        considered = (*prefill, *decode)
        if route == "local":
            return RoutePlan((d.info,), "local", key, d.uncached_tokens, considered=considered)
        fetched = self._reuse(p, d, key)
        return RoutePlan((p.info, d.info), "remote", key, p.uncached_tokens - fetched, considered=considered,
                         reuse_decode_kv=fetched > 0)

    def begin(self, plan: RoutePlan) -> None:
        """The attempt is being sent: count it. A prefill worker caches the prompt as soon as it has
        sent the KV, so its view is updated now (later prompts with this prefix then follow it)."""
        for w in plan.workers:
            self.inflight[w.worker_id] += 1
            if plan.key.adapter:
                self.inflight_adapters[w.worker_id, plan.key.adapter] += 1
        self.inflight_tokens[plan.prefilling_worker] += plan.prefill_tokens
        if plan.prefill is not None:
            self.cache.record(plan.prefill.worker_id, plan.key, capacity=plan.prefill.load.total_pages)

    def first_token(self, plan: RoutePlan) -> None:
        """The prompt is prefilled: its tokens no longer count as queued work."""
        if not plan.first_token:
            plan.first_token = True
            _sub(self.inflight_tokens, plan.prefilling_worker, plan.prefill_tokens)

    def end(self, plan: RoutePlan, output_ids: Sequence[int] = ()) -> None:
        """The attempt is over. A decode (or co-located) worker puts the prompt's pages in its prefix
        cache only when the request finishes: the router counts them from then on, so that a local
        prefill is never chosen for a prefix still held by a running request only. With the prompt's
        token ids, `output_ids` (what the client got) count too: the worker caches the answer as well,
        which the next turn of a conversation repeats (every token but the last has KV there)."""
        self.first_token(plan)
        for w in plan.workers:
            _sub(self.inflight, w.worker_id, 1)
            if plan.key.adapter:
                _sub(self.inflight_adapters, (w.worker_id, plan.key.adapter), 1)
        key = plan.key
        if key.token_ids is not None and len(output_ids) > 1:
            key = PromptKey.of(token_ids=[*key.token_ids, *output_ids[:-1]], adapter=key.adapter)
        self.cache.record(plan.decode.worker_id, key, capacity=plan.decode.load.total_pages)

    def retain(self, worker_ids: Iterable[str]) -> None:
        """Workers that left the registry: forget what the router believed they cached."""
        self.cache.retain(worker_ids)

    # ---- internals --------------------------------------------------------------------------
    def _candidate(self, w: worker_pb2.WorkerInfo, key: PromptKey) -> Candidate:
        # An adapter's prompt is hashed from its key in the exact view, which the worker reports with the
        # adapter while loaded; otherwise the approximate view (the adapter's own key space there) answers.
        parent = adapter_block_parent(w, key.adapter) if key.adapter else None
        exact = self.exact if not key.adapter or parent is not None else None
        cached = exact.cached_tokens(w, key.token_ids, parent) if exact is not None else None
        if cached is None:
            cached = self.cache.cached_tokens(w.worker_id, key)
        return Candidate(w, self.inflight[w.worker_id], self.inflight_tokens[w.worker_id], cached, key.num_tokens)

    def _candidates(self, workers: Sequence[worker_pb2.WorkerInfo], key: PromptKey) -> list[Candidate]:
        return [self._candidate(w, key) for w in workers]

    def _pick(self, role: int, request: RouteRequest, candidates: list[Candidate]) -> Candidate:
        def routed(worker_id: str) -> bool:
            return (worker_id, request.adapter) in self.inflight_adapters
        return self.policies[role].pick(request, lora_affinity(request.adapter, candidates, self.cfg, routed))

    def _local_sooner(self, d: Candidate, prefill: list[Candidate]) -> bool:
        """Short enough for D, and D would start it no later than the least busy prefill worker."""
        if not 0 <= d.uncached_tokens <= self.cfg.local_prefill_max_tokens:
            return False
        if not self._keeps_itl(d):
            return False
        local = d.prefill_cost * (BUSY_DECODE_SLOWDOWN if d.requests else 1.0)
        return local <= min(p.prefill_cost for p in prefill)

    def _keeps_itl(self, d: Candidate) -> bool:
        """D's running requests keep an inter-token latency within the bound while it prefills this
        prompt (and everything it already has queued); unknown (no step-cost fit yet) or nothing
        running: yes."""
        bound = self.cfg.local_prefill_max_itl_ms / 1e3
        if not bound or not d.info.load.running:
            return True
        itl = d.itl_with_prefill_s(d.prefill_cost, MIXED_CHUNK_ITL_FACTOR)
        return itl is None or itl <= bound

    def _reuse(self, p: Candidate, d: Candidate, key: PromptKey) -> int:
        """Prompt tokens P fetches from D (KV both ways; cost.py `reuse_tokens`), by --kv-reuse-policy.
        What D holds is the larger of its two views: the answer D caches as the previous turn ends
        reaches the exact view (KV events) a little later, and the next turn may come sooner; a belief
        that is wrong costs nothing, since P fetches only what D's Bootstrap says it holds."""
        policy = self.cfg.kv_reuse_policy
        held = max(d.cached_tokens, self.cache.cached_tokens(d.worker_id, key))
        if policy == "never" or held <= p.cached_tokens:
            return 0
        d = dataclasses.replace(d, cached_tokens=held)
        tokens = held - p.cached_tokens if policy == "always" else reuse_tokens(p, d, self.cfg.kv_link_gbps)
        if self.on_reuse is not None:
            self.on_reuse("fetch" if tokens else "compute")
        return tokens

    def _saturated(self, prefill: list[Candidate]) -> bool:
        limit = self.cfg.max_prefill_queue_tokens
        return limit > 0 and all(p.queued_tokens > limit for p in prefill)


def _sub(counter: Counter, key: object, n: int) -> None:
    counter[key] -= n
    if counter[key] <= 0:
        del counter[key]


def prompt_key(request, adapter: str = "") -> PromptKey:
    """The routing key of a `GenerateRequest` (`adapter`: the LoRA adapter its `model` names, if any)."""
    if request.HasField("token_ids"):
        return PromptKey.of(token_ids=request.token_ids.ids, adapter=adapter)
    return PromptKey.of(text=request.text, adapter=adapter)
