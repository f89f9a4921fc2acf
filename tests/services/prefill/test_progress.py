"""What a prefill worker reports about its rooms, and when (torch-free: a real scheduler, no model)."""

from __future__ import annotations

import pytest

from tandem.engine.config import EngineConfig
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler.batch import SampledToken
from tandem.engine.scheduler.request import Request
from tandem.engine.scheduler.scheduler import Scheduler
from tandem.kvtransfer.base import RoomState
from tandem.services.prefill.progress import DEFAULT_S_PER_TOKEN, PrefillPace, ProgressReporter
from tandem.services.prefill.rooms import BootstrapInfo, PrefillRoom

CFG = EngineConfig(page_size=4, chunked_prefill_size=16, max_running_requests=8, prefill_schedule_policy="fcfs",
                   init_new_token_ratio=0, min_new_token_ratio=0)


class RecordingSender:
    def __init__(self):
        self.sent: list[tuple[str, int, object]] = []

    def progress(self, peer_id, room, progress):
        self.sent.append((peer_id, room, progress))

    def take(self) -> dict[int, object]:
        out = {room: p for _, room, p in self.sent}
        self.sent.clear()
        return out


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup():
    clock, sender = Clock(), RecordingSender()
    sched = Scheduler(CFG, num_pages=64, context_len=256, clock=clock)
    reporter = ProgressReporter(sender, interval_s=1.0, clock=clock)
    rooms: dict[str, PrefillRoom] = {}

    def admit(room_id: int, n: int) -> PrefillRoom:
        req = Request(f"r{room_id}", list(range(1, n + 1)), SamplingParams(max_tokens=1))
        room = PrefillRoom(room_id, req=req, info=BootstrapInfo("d", [0], 0))
        rooms[req.rid] = room
        sched.add(req)
        reporter.admitted(room)
        return room

    return clock, sender, sched, reporter, rooms, admit


def run_step(sched: Scheduler) -> None:
    batch = sched.schedule()
    sched.on_step_done(batch, [SampledToken(7) for _ in batch.sampling])


def test_pace_is_pessimistic_until_measured_then_follows_the_steps():
    pace = PrefillPace(weight=0.5)
    assert pace.step_s(100) == pytest.approx(100 * DEFAULT_S_PER_TOKEN)
    pace.observe(0, 1.0)                     # a step without prompt tokens says nothing
    pace.observe(100, 0.0)
    assert pace.steps == 0
    pace.observe(100, 0.2)                   # the first measurement replaces the default
    assert pace.step_s(10) == pytest.approx(0.02)
    pace.observe(100, 0.4)
    assert pace.step_s(10) == pytest.approx(0.03)


def test_rooms_are_reported_in_queue_order_with_the_tokens_ahead_of_them(setup):
    clock, sender, sched, reporter, rooms, admit = setup
    admit(1, 20)
    admit(2, 10)
    reporter.before_step(sched, rooms)
    got = sender.take()
    assert set(got) == {1, 2}
    assert (got[1].tokens_done, got[1].tokens_total, got[1].queued_ahead) == (0, 20, 0)
    assert (got[2].tokens_done, got[2].tokens_total, got[2].queued_ahead) == (0, 10, 20)
    # Nothing measured yet: the 16-token step is priced at the pessimistic default, and the next
    # report is due after the report interval plus that step.
    assert got[1].expected_s == pytest.approx(1.0 + 16 * DEFAULT_S_PER_TOKEN)
    run_step(sched)                          # room 1's first chunk: 16 tokens
    clock.now += 1.0
    reporter.before_step(sched, rooms)
    got = sender.take()
    assert (got[1].tokens_done, got[1].queued_ahead) == (16, 0)
    assert (got[2].tokens_done, got[2].queued_ahead) == (0, 4)


def test_a_room_computing_before_its_bootstrap_is_counted_ahead_but_not_reported(setup):
    clock, sender, sched, reporter, rooms, admit = setup
    early = admit(1, 20)
    early.info = None                         # D's Bootstrap has not come: no one to report to
    admit(2, 10)
    reporter.before_step(sched, rooms)
    got = sender.take()
    assert set(got) == {2} and got[2].queued_ahead == 20


def test_reports_are_throttled_but_a_new_room_is_reported_before_the_next_step(setup):
    clock, sender, sched, reporter, rooms, admit = setup
    reporter.pace.observe(16, 0.016)         # 1 ms per token: short steps
    admit(1, 40)
    reporter.before_step(sched, rooms)
    assert set(sender.take()) == {1}
    run_step(sched)
    clock.now += 0.5
    reporter.before_step(sched, rooms)
    assert sender.take() == {}               # reported 0.5 s ago
    admit(2, 8)
    reporter.before_step(sched, rooms)
    assert set(sender.take()) == {2}         # only the newcomer
    clock.now += 0.5
    reporter.before_step(sched, rooms)
    got = sender.take()
    assert set(got) == {1, 2} and got[1].expected_s == pytest.approx(1.016)


def test_a_step_longer_than_the_interval_is_announced_before_every_step(setup):
    clock, sender, sched, reporter, rooms, admit = setup
    reporter.pace.observe(16, 16 * 0.1)      # 1.6 s per 16-token step
    admit(1, 64)
    for _ in range(3):
        reporter.before_step(sched, rooms)
        got = sender.take()
        assert set(got) == {1} and got[1].expected_s == pytest.approx(1.6)
        run_step(sched)
        clock.now += 0.01                    # whatever the clock says


def test_failed_or_forgotten_rooms_are_not_reported(setup):
    clock, sender, sched, reporter, rooms, admit = setup
    admit(1, 8).state = RoomState.FAILED     # failed, not yet out of the scheduler
    admit(2, 8)
    reporter.before_step(sched, rooms)
    assert set(sender.take()) == {2}
    reporter.forget(admit(3, 8))             # closed before the next step
    reporter.before_step(sched, rooms)
    assert sender.sent == []


def test_nothing_is_reported_for_requests_that_are_not_rooms(setup):
    clock, sender, sched, reporter, rooms, admit = setup
    sched.add(Request("plain", [1, 2, 3], SamplingParams(max_tokens=1)))
    reporter.before_step(sched, rooms)
    assert sender.sent == []
