from __future__ import annotations

import pytest

from services.router.policy import LeastLoad, RoundRobin, make_policy, policy_names
from tandem.v1 import worker_pb2


def _w(wid: str, running=0, waiting=0, free=0, total=0) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        worker_id=wid, load=worker_pb2.WorkerLoad(running=running, waiting=waiting, free_pages=free, total_pages=total)
    )


def test_registry_of_policies():
    assert {"round_robin", "least_load"} <= set(policy_names())
    assert isinstance(make_policy("round_robin"), RoundRobin)
    assert isinstance(make_policy("least_load"), LeastLoad)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random_walk")


def test_round_robin_cycles_and_survives_membership_changes():
    rr = make_policy("round_robin")
    ws = [_w("a"), _w("b"), _w("c")]
    assert [rr.pick(ws, {}).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert rr.pick(ws[:1], {}).worker_id == "a"  # a shrunken list still yields a worker


def test_least_load_counts_reported_load_and_own_inflight():
    ll = make_policy("least_load")
    ws = [_w("a", running=2, waiting=1), _w("b", running=1), _w("c", running=1, waiting=1)]
    assert ll.pick(ws, {}).worker_id == "b"
    # Requests this router sent since the last heartbeat count too.
    assert ll.pick(ws, {"b": 2}).worker_id == "c"


def test_least_load_breaks_ties_by_free_pages_then_order():
    ll = make_policy("least_load")
    ws = [_w("a", free=10, total=100), _w("b", free=90, total=100), _w("c", free=90, total=100)]
    assert ll.pick(ws, {}).worker_id == "b"
