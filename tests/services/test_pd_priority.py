"""Priorities and queue limits in the disaggregated workers (driven by hand, as test_pd_workers)."""

from __future__ import annotations

import dataclasses

from tandem.engine.errors import ResourceExhausted
from tandem.engine.sampling_params import SamplingParams
from tandem.services.decode.worker import DecodeRoom
from tandem.services.prefill.rooms import BootstrapInfo
from tandem.v1 import worker_pb2
from tests.services.test_pd_workers import drive, pair  # noqa: F401 (a fixture)

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def test_decode_prealloc_is_ordered_by_priority_and_turns_away_the_lowest(pair):  # noqa: F811
    prefill, decode, _ = pair
    # As `--enable-priority-scheduling --max-queued-requests 2` would build it.
    decode.sched.policy = decode.prealloc.policy = dataclasses.replace(decode.sched.policy, enable_priority=True)
    decode.max_prealloc = 2
    results: dict[str, list] = {}

    def add(room_id: int, priority: int) -> None:
        rid = f"r{room_id}"
        prefill.add_prefill(room_id, rid, [5, 6, 7, 8, 9], PARAMS, lambda _: None, priority)
        req = decode.engine.make_request([5, 6, 7, 8, 9], PARAMS, rid, priority)
        decode.add(DecodeRoom(room_id, req, "p:0", "p", results.setdefault(rid, []).append))

    add(1, 0)
    add(2, 3)
    try:
        add(3, 0)
        raise AssertionError("a full queue took the lowest newcomer")
    except ResourceExhausted as e:
        assert "decode prealloc queue is full" in str(e)
        prefill.abort_request("r3", "decode refused")  # what the router's cancel does
    add(4, 9)  # pushes out room 1, the lowest
    [err] = results["r1"]
    assert isinstance(err, ResourceExhausted) and "higher priority (9)" in str(err)
    prefill.abort_request("r1", "decode refused")
    assert [r.room for r in decode.prealloc] == [4, 2]
    # D can finish a short answer before P has polled its sender and closed the room: wait for both.
    drive(prefill, decode, lambda: not prefill.rooms and all(
        results.get(f"r{i}") and getattr(results[f"r{i}"][-1], "finished", False) for i in (2, 4)))
    assert not decode.streams and not prefill.rooms
    prefill.engine.check_idle()
    decode.engine.check_idle()


def test_prefill_waiting_queue_turns_away_the_lowest_with_resource_exhausted(pair):  # noqa: F811
    prefill, decode, _ = pair
    sched = prefill.sched
    sched.cfg = dataclasses.replace(sched.cfg, max_queued_requests=1)
    sched.policy = sched.waiting.policy = dataclasses.replace(sched.policy, enable_priority=True)
    answers: dict[int, list] = {}
    for room_id, priority in ((1, 0), (2, 5)):
        prefill.add_prefill(room_id, f"r{room_id}", [5, 6, 7, 8, 9], PARAMS, answers.setdefault(room_id, []).append,
                            priority)
        prefill.bootstrap(room_id, BootstrapInfo("d", [0, 1], 0))  # never stepped: both wait for compute
    [err] = answers[1]
    assert isinstance(err, ResourceExhausted) and "higher priority (5)" in str(err)
    assert 1 not in prefill.rooms and [r.rid for r in sched.waiting] == ["r2"]
    prefill.abort_room(2, "test over")
    assert answers[2][0].state == worker_pb2.TRANSFER_STATE_FAILED
    prefill.engine.check_idle()
