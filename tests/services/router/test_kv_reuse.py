"""KV both ways, the router's half (torch-free): the cost model fetches what D holds beyond P's cache
only when moving it beats computing it, the policy flag overrides it, and the router's approximate
view learns that a finished request's answer is cached on its decode worker (the next turn repeats it)."""

from __future__ import annotations

import pytest

from tandem.services.router.cache_view import PromptKey
from tandem.services.router.cost import FETCH_OVERHEAD_S, Candidate, reuse_tokens
from tandem.services.router.planner import RoutePlanner
from tandem.services.router.route_config import RouteConfig
from tandem.v1 import worker_pb2

P, D = worker_pb2.WORKER_ROLE_PREFILL, worker_pb2.WORKER_ROLE_DECODE
BPT = 23040           # SmolLM2-135M, bf16: 30 layers x K and V x 3 heads x 64 x 2 bytes


def _w(wid: str, role: int, per_token_s: float = 0.0, fetch_gbps: float = 0.0) -> worker_pb2.WorkerInfo:
    w = worker_pb2.WorkerInfo(worker_id=wid, role=role, kv_bytes_per_token=BPT,
                              load=worker_pb2.WorkerLoad(kv_fetch_gbps=fetch_gbps))
    if per_token_s:
        w.load.step_cost.CopyFrom(worker_pb2.StepCost(base_s=0.01, per_prefill_token_s=per_token_s, steps=20))
    return w


def _pair(p_cached: int, d_cached: int, per_token_s: float = 0.0, fetch_gbps: float = 0.0):
    return (Candidate(_w("p", P, per_token_s, fetch_gbps), cached_tokens=p_cached, prompt_tokens=2000),
            Candidate(_w("d", D), cached_tokens=d_cached, prompt_tokens=2000))


def test_fetch_pays_when_moving_the_kv_beats_computing_it():
    # A 2-core CPU computes ~0.7 ms per prompt token; at 1 Gbit/s a token's KV moves in ~0.18 ms.
    assert reuse_tokens(*_pair(512, 1024, per_token_s=7e-4), link_gbps=1.0) == 512
    # A GPU computes a token in ~20 us: over 1 Gbit/s the fetch loses, over 100 Gbit/s it wins.
    assert reuse_tokens(*_pair(512, 1024, per_token_s=2e-5), link_gbps=1.0) == 0
    assert reuse_tokens(*_pair(512, 1024, per_token_s=2e-5), link_gbps=100.0) == 512
    # P's measured fetch rate wins over the assumed link.
    assert reuse_tokens(*_pair(512, 1024, per_token_s=2e-5, fetch_gbps=100.0), link_gbps=1.0) == 512
    # A handful of tokens does not pay for the call's fixed cost.
    per = FETCH_OVERHEAD_S / 32
    assert reuse_tokens(*_pair(0, 16, per_token_s=per), link_gbps=100.0) == 0
    # No step-cost fit yet: the fetch is taken; D holding no more than P: nothing to fetch.
    assert reuse_tokens(*_pair(0, 64), link_gbps=1.0) == 64
    assert reuse_tokens(*_pair(64, 64), link_gbps=1.0) == 0


@pytest.mark.parametrize("policy, expected", [("auto", False), ("always", True), ("never", False)])
def test_the_policy_flag_decides_over_the_cost_model(policy, expected):
    decisions: list[str] = []
    planner = RoutePlanner("least_load", RouteConfig(kv_reuse_policy=policy, kv_link_gbps=1.0,
                                                     local_prefill_max_tokens=-1), (P, D), on_reuse=decisions.append)
    conversation = list(range(1, 1025))
    turn1 = PromptKey.of(token_ids=conversation[:512])
    answer = conversation[512:1000]
    # Turn 1 ran on (p, d): P cached its prompt; D its prompt and answer (the router saw both).
    p, d = _w("p", P, per_token_s=2e-5), _w("d", D)                      # a fast prefill worker
    first = planner.plan(turn1, {P: [p], D: [d]})
    planner.begin(first)
    planner.end(first, answer)
    plan = planner.plan(PromptKey.of(token_ids=conversation), {P: [p], D: [d]})
    assert plan.route == "remote" and plan.reuse_decode_kv is expected
    assert decisions == ([] if policy == "never" else ["fetch" if expected else "compute"])
    if expected:
        assert plan.prefill_tokens == 1024 - 992      # D holds 62 blocks of 16: P computes the rest


def test_the_decode_workers_cached_answer_is_seen_and_fetched_when_it_pays():
    planner = RoutePlanner("least_load", RouteConfig(local_prefill_max_tokens=-1), (P, D))
    p, d = _w("p", P, per_token_s=7e-4), _w("d", D)
    turn1 = PromptKey.of(token_ids=list(range(1, 200)))
    plan = planner.plan(turn1, {P: [p], D: [d]})
    planner.begin(plan)
    planner.end(plan, list(range(200, 300)))
    turn2 = PromptKey.of(token_ids=list(range(1, 330)))
    plan2 = planner.plan(turn2, {P: [p], D: [d]})
    # P holds turn 1's 12 blocks (192 tokens); D those and the answer: 18 blocks (288 tokens).
    assert plan2.reuse_decode_kv and plan2.prefill_tokens == 329 - 288


def test_kv_reuse_flags_are_checked():
    with pytest.raises(ValueError, match="kv-reuse-policy"):
        RouteConfig(kv_reuse_policy="sometimes").validate()
    with pytest.raises(ValueError, match="kv-link-gbps"):
        RouteConfig(kv_link_gbps=0).validate()


def test_an_answer_the_exact_view_has_not_heard_of_yet_still_counts_for_the_fetch():
    """D caches the answer as the turn ends; its KV events reach the router a little later, and the next
    turn may come first: the router's own record of the answer counts."""

    class Lagging:   # the exact view: each worker holds turn 1's prompt only
        def cached_tokens(self, worker, token_ids, parent=None):
            return 192

    planner = RoutePlanner("least_load", RouteConfig(local_prefill_max_tokens=-1), (P, D), exact=Lagging())
    p, d = _w("p", P, per_token_s=7e-4), _w("d", D)
    plan = planner.plan(PromptKey.of(token_ids=list(range(1, 200))), {P: [p], D: [d]})
    planner.begin(plan)
    planner.end(plan, list(range(200, 300)))
    plan2 = planner.plan(PromptKey.of(token_ids=list(range(1, 330))), {P: [p], D: [d]})
    assert plan2.reuse_decode_kv and plan2.prefill_tokens == 329 - 288
