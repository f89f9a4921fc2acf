"""Policies and the planner on constructed states (torch-free, no processes)."""

from __future__ import annotations

import pytest

from tandem.services.router.cache_view import BLOCK_TOKENS, PrefixCacheView, PromptKey
from tandem.services.router.cost import Candidate
from tandem.services.router.planner import RoutePlanner
from tandem.services.router.policy import LeastLoad, RoundRobin, RouteRequest, make_policy, policy_names
from tandem.services.router.route_config import RouteConfig
from tandem.v1 import worker_pb2

P, D = worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE
BASE = RouteRequest(PromptKey.of([1, 2, 3]))


def _w(wid: str, running=0, waiting=0, free=0, total=0, tokens=0) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(worker_id=wid, load=worker_pb2.WorkerLoad(
        running=running, waiting=waiting, free_pages=free, total_pages=total, prefill_tokens=tokens))


def _c(wid: str, inflight=0, cached=0, prompt=0, inflight_tokens=0, **load) -> Candidate:
    return Candidate(_w(wid, **load), inflight, inflight_tokens, cached, prompt)


def test_registry_of_policies():
    assert {"round_robin", "least_load", "cache_aware"} <= set(policy_names())
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("least_load"), LeastLoad)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random_walk")


def test_round_robin_cycles_and_survives_membership_changes():
    rr = make_policy("round_robin")
    cs = [_c("a"), _c("b"), _c("c")]
    assert [rr.pick(BASE, cs).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.pick(BASE, cs[:1]).worker_id == "a"  # a shrunken list still yields a worker


def test_least_load_prefers_least_queued_prefill_tokens_then_requests():
    ll = make_policy("least_load")
    # "a" has fewer requests but one 3,000-token prompt queued: "b"'s two short ones are less work.
    assert ll.pick(BASE, [_c("a", waiting=1, tokens=3000), _c("b", waiting=2, tokens=100)]).worker_id == "b"
    # What this router sent since the last heartbeat counts when it is more than the report.
    assert ll.pick(BASE, [_c("a", tokens=100, inflight_tokens=900), _c("b", tokens=500)]).worker_id == "b"
    cs = [_c("a", running=2, waiting=1), _c("b", running=1), _c("c", running=1, waiting=1)]
    assert ll.pick(BASE, cs).worker_id == "b"
    assert ll.pick(BASE, [_c("a", running=2), _c("b", running=1, inflight=2), _c("c", running=2)]).worker_id == "a"


def test_least_load_breaks_ties_by_free_pages_then_order():
    ll = make_policy("least_load")
    cs = [_c("a", free=10, total=100), _c("b", free=90, total=100), _c("c", free=90, total=100)]
    assert ll.pick(BASE, cs).worker_id == "b"


def test_cache_aware_prefers_the_prefix_match_while_balanced():
    ca = make_policy("cache_aware", RouteConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    cs = [_c("a", running=3, prompt=1100), _c("b", running=5, cached=1024, prompt=1100)]
    assert ca.pick(BASE, cs).worker_id == "b"
    # ... but not when its queue holds more work than the match saves.
    cs = [_c("a", running=3, prompt=1100), _c("b", running=5, cached=1024, prompt=1100, tokens=2000)]
    assert ca.pick(BASE, cs).worker_id == "a"


def test_cache_aware_imbalance_overrides_the_cache():
    ca = make_policy("cache_aware", RouteConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    cs = [_c("a", running=1, prompt=1100), _c("b", running=6, cached=1024, prompt=1100)]
    assert ca.pick(BASE, cs).worker_id == "a"  # 6 - 1 > 4 and 6 > 1.5 * 1
    # Both thresholds must be exceeded: a gap of 5 between 20 and 25 is within 1.5x.
    cs = [_c("a", running=20, prompt=1100), _c("b", running=25, cached=1024, prompt=1100)]
    assert ca.pick(BASE, cs).worker_id == "b"


def test_prompt_keys_share_whole_block_prefixes_only():
    a = PromptKey.of(token_ids=list(range(40)))
    b = PromptKey.of(token_ids=list(range(32)) + [99] * 8)
    assert len(a.blocks) == 2 and a.blocks == b.blocks[:2]
    assert PromptKey.of(token_ids=[1] * 15).blocks == ()
    assert PromptKey.of(text="x" * 64).blocks != PromptKey.of(token_ids=[120] * 16).blocks
    assert PromptKey.of(text="abcd" * 40).num_tokens == 40


def test_cache_view_matches_expires_and_forgets_departed_workers():
    now = [0.0]
    view = PrefixCacheView(ttl_s=10.0, clock=lambda: now[0])
    sys_prompt = list(range(1024))
    view.record("p1", PromptKey.of(token_ids=sys_prompt + [7] * 64))
    key = PromptKey.of(token_ids=sys_prompt + [8] * 64)
    assert view.cached_tokens("p1", key) == 1024 and view.cached_tokens("p2", key) == 0
    now[0] = 9.0
    assert view.cached_tokens("p1", key) == 1024
    now[0] = 10.5  # past the ttl since the last use
    assert view.cached_tokens("p1", key) == 0 and view.size("p1") == 0
    view.record("p1", key)
    view.retain(["p2"])  # p1 left the registry
    assert view.cached_tokens("p1", key) == 0


def test_cache_view_capacity_evicts_tails_before_heads():
    view = PrefixCacheView(ttl_s=100.0)
    head = list(range(4 * BLOCK_TOKENS))
    view.record("w", PromptKey.of(token_ids=head), capacity=4)
    view.record("w", PromptKey.of(token_ids=[5] * (2 * BLOCK_TOKENS)), capacity=4)
    # Two new blocks pushed out two of the first prompt's: its last ones, so its head still matches.
    assert view.cached_tokens("w", PromptKey.of(token_ids=head)) == 2 * BLOCK_TOKENS


def _planner(**kw) -> tuple[RoutePlanner, list[str]]:
    routes: list[str] = []
    return RoutePlanner("cache_aware", RouteConfig(**kw), (P, D), on_route=routes.append), routes


def test_short_or_cached_prompts_are_prefilled_on_the_decode_worker():
    planner, routes = _planner(local_prefill_max_tokens=64)
    ps, ds = [_w("p0"), _w("p1")], [_w("d0")]
    short = planner.plan(PromptKey.of(token_ids=[1] * 40), {P: ps, D: ds})
    assert short.route == "local" and short.prefill is None and short.decode.worker_id == "d0"
    long_key = PromptKey.of(token_ids=list(range(1000)))
    remote = planner.plan(long_key, {P: ps, D: ds})
    assert remote.route == "remote" and remote.prefill is not None
    planner.begin(remote)
    planner.end(remote)  # d0 now holds the prompt's prefix: the same prompt again is prefilled there
    again = planner.plan(long_key, {P: ps, D: ds})
    assert again.route == "local"
    assert routes == ["local", "remote", "local"]
    assert not planner.inflight and not planner.inflight_tokens


def test_a_busy_decode_worker_leaves_short_prompts_to_an_idle_prefill_worker():
    planner, routes = _planner(local_prefill_max_tokens=1024)
    key = PromptKey.of(token_ids=list(range(256)))
    assert planner.plan(key, {P: [_w("p0")], D: [_w("d0")]}).route == "local"             # both idle
    busy_d = [_w("d0", running=6)]
    assert planner.plan(key, {P: [_w("p0")], D: busy_d}).route == "remote"                # P idle: use it
    assert planner.plan(key, {P: [_w("p0", tokens=300)], D: busy_d}).route == "local"     # 2 x 256 <= 300 + 256
    assert planner.plan(key, {P: [_w("p0", tokens=200)], D: busy_d}).route == "remote"    # 2 x 256 > 200 + 256
    assert routes == ["local", "remote", "local", "remote"]


def _fitted(wid: str, running: int, base_s: float, per_row_s: float, per_token_s: float, **load):
    w = _w(wid, running=running, **load)
    w.load.step_cost.CopyFrom(worker_pb2.StepCost(base_s=base_s, per_decode_row_s=per_row_s,
                                                  per_prefill_token_s=per_token_s, steps=50))
    return w


def test_a_local_prefill_that_would_break_the_decode_workers_itl_goes_remote():
    """D's running requests' inter-token latency while D prefills: one decode step plus the prompt's
    compute, at most 1.5 steps (the mixed-chunk bound). Over --local-prefill-max-itl-ms: remote, even
    when D would start it sooner; with the bound off, local as before."""
    key = PromptKey.of(token_ids=list(range(256)))
    busy_p = [_w("p0", tokens=4000)]                   # P's queue makes D sooner by the token rule
    light = [_fitted("d0", running=4, base_s=0.02, per_row_s=0.002, per_token_s=0.0002)]   # step 30 ms
    heavy = [_fitted("d0", running=20, base_s=0.02, per_row_s=0.004, per_token_s=0.0002)]  # step 104 ms
    planner, routes = _planner(local_prefill_max_tokens=1024)
    assert planner.plan(key, {P: busy_p, D: light}).route == "local"      # 30 ms + 15 ms <= 150 ms
    assert planner.plan(key, {P: busy_p, D: heavy}).route == "remote"     # 104 ms + 52 ms > 150 ms
    unbounded, _ = _planner(local_prefill_max_tokens=1024, local_prefill_max_itl_ms=0)
    assert unbounded.plan(key, {P: busy_p, D: heavy}).route == "local"
    assert _c("d0").itl_with_prefill_s(100, 1.5) is None                  # no fit reported yet
    short = PromptKey.of(token_ids=list(range(20)))                       # 104 ms + 4 ms: within
    assert planner.plan(short, {P: busy_p, D: heavy}).route == "local"
    # Saturated prefill workers: D only if its streams keep their latency.
    saturated, _ = _planner(local_prefill_max_tokens=-1, max_prefill_queue_tokens=1000)
    assert saturated.plan(key, {P: busy_p, D: light}).route == "local"
    assert saturated.plan(key, {P: busy_p, D: heavy}).route == "remote"
    assert routes == ["local", "remote", "local"]
    with pytest.raises(ValueError, match="local-prefill-max-itl-ms"):
        RouteConfig(local_prefill_max_itl_ms=-1).validate()


def test_saturated_prefill_workers_send_the_prompt_to_the_decode_worker_when_sooner():
    planner, routes = _planner(local_prefill_max_tokens=-1, max_prefill_queue_tokens=4000)
    key = PromptKey.of(token_ids=list(range(1500)))
    busy = [_w("p0", tokens=6000), _w("p1", tokens=5000)]
    assert planner.plan(key, {P: busy, D: [_w("d0")]}).route == "local"
    # One prefill worker with room: remote.
    assert planner.plan(key, {P: [busy[0], _w("p1", tokens=100)], D: [_w("d0")]}).route == "remote"
    # All saturated but the decode worker has even more queued: remote.
    assert planner.plan(key, {P: busy, D: [_w("d0", tokens=9000)]}).route == "remote"
    assert routes == ["local", "remote", "remote"]


def test_planner_counts_its_own_queued_tokens_until_the_first_token():
    planner, _ = _planner(local_prefill_max_tokens=-1)
    ps, ds = [_w("p0"), _w("p1")], [_w("d0")]
    first = planner.plan(PromptKey.of(token_ids=list(range(2000))), {P: ps, D: ds})
    planner.begin(first)
    assert planner.inflight_tokens[first.prefill.worker_id] == 2000
    # The next prompt (no shared prefix) goes to the other prefill worker: less queued work.
    second = planner.plan(PromptKey.of(token_ids=[3] * 500), {P: ps, D: ds})
    assert second.prefill.worker_id != first.prefill.worker_id
    planner.first_token(first)
    assert first.prefill.worker_id not in planner.inflight_tokens and planner.inflight[first.decode.worker_id] == 1
    planner.end(first)
    assert not planner.inflight
