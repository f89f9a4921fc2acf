"""The decode worker's transfer timeout follows the prefill worker's progress reports.

Prefill and decode workers in one process over a real tcp transfer, stepped by hand (as in
test_pd_workers.py): a "slow CPU" is a prefill worker whose steps are run only every so often.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from tandem.engine.engine import LLMEngine
from tandem.engine.sampling_params import SamplingParams
from tandem.kvtransfer.base import Progress
from tandem.services.decode.worker import DecodeTimeouts, TransferFailed
from tandem.services.prefill.worker import PrefillTimeouts
from tandem.services.worker import metrics
from tests.services.test_pd_workers import BASE, make_pair, submit

TRANSFER_S = 0.4
REPORT_S = 0.05             # the prefill worker's report interval, shortened like the timeout
PROMPT = list(range(3, 103))  # 100 tokens in 16-token chunks: 7 prefill steps


@pytest.fixture
def pair(tiny_llama):
    prefill, decode, peers = make_pair(tiny_llama, PrefillTimeouts(bootstrap_s=5.0, transfer_s=5.0),
                                       DecodeTimeouts(transfer_s=TRANSFER_S))
    prefill.progress.interval_s = REPORT_S
    yield prefill, decode
    prefill.sender.close()
    peers.receiver.close()


def drive_slow(prefill, decode, until, step_every_s: float, prefill_steps: int | None = None, timeout_s: float = 20.0):
    """D runs flat out; P ticks as usual but runs a step only every `step_every_s` (and at most
    `prefill_steps` of them: after that its engine is stuck). Returns the last progress report D saw
    for each room."""
    deadline = time.monotonic() + timeout_s
    next_step, steps, seen = 0.0, 0, {}
    while not until():
        assert time.monotonic() < deadline, "workers made no progress"
        prefill.tick()
        now = time.monotonic()
        if prefill.has_work() and now >= next_step and (prefill_steps is None or steps < prefill_steps):
            prefill.step()
            steps += 1
            next_step = now + step_every_s
        decode.tick()
        for room in decode.transfer:
            seen[room] = decode.receiver.poll(room).progress or seen.get(room)
        if decode.has_work():
            decode.step()
        time.sleep(0.002)
    return seen


def test_the_deadline_follows_the_reports():
    t = DecodeTimeouts(transfer_s=30.0, progress_factor=2.0, max_expected_s=100.0)
    assert t.deadline(10.0, None) == 40.0
    assert t.deadline(10.0, Progress(5, 100, 0, expected_s=4.0, at=50.0)) == 50.0 + 30.0 + 8.0
    assert t.deadline(10.0, Progress(5, 100, 0, expected_s=0.0, at=10.0)) == 40.0   # a report takes nothing away
    assert t.deadline(10.0, Progress(5, 100, 0, expected_s=1e9, at=50.0)) == 50.0 + 30.0 + 200.0
    # A computed prompt's KV still crossing a slow link: each landed piece moves the deadline.
    assert t.deadline(10.0, Progress(100, 100, 0, expected_s=1.0, at=20.0), landed_at=45.0) == 45.0 + 30.0
    assert t.deadline(10.0, None, landed_at=5.0) == 40.0                               # nothing landed since


def test_a_prefill_slower_than_the_transfer_timeout_is_waited_for_while_it_reports(pair, tiny_llama):
    prefill, decode = pair
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    results, responses = {}, []
    outlived = metrics.TRANSFER_OUTLIVED_TIMEOUT._value.get()
    t0 = time.monotonic()
    submit(prefill, decode, 1, PROMPT, params, results, responses)
    drive_slow(prefill, decode, lambda: not decode.streams, step_every_s=0.2)
    assert time.monotonic() - t0 > 3 * TRANSFER_S          # the prefill alone took that long
    ref = LLMEngine(dataclasses.replace(BASE, model=str(tiny_llama))).generate([PROMPT], params)[0]
    assert [t for o in results["r1"] for t in o.token_ids] == ref.token_ids
    assert decode.receiver.progress_reports >= 5
    assert metrics.TRANSFER_OUTLIVED_TIMEOUT._value.get() == outlived + 1
    prefill.engine.check_idle()
    decode.engine.check_idle()


def test_a_prefill_worker_that_stops_reporting_fails_the_room_a_timeout_after_its_last_report(pair):
    prefill, decode = pair
    results = {}
    submit(prefill, decode, 2, PROMPT, SamplingParams(max_tokens=4), results, [])
    seen = drive_slow(prefill, decode, lambda: results["r2"], step_every_s=0.2, prefill_steps=3)
    failed_at = time.monotonic()
    [err] = results["r2"]
    last = seen[2]
    assert isinstance(err, TransferFailed) and err.failed_worker == "p"
    assert "timed out: no progress for" in str(err) and "32 of 100 prompt tokens done, 0 queued ahead" in str(err)
    # It was given the timeout after the last report plus the slack that report asked for, no more.
    waited = failed_at - last.at
    assert TRANSFER_S < waited < TRANSFER_S + 2 * last.expected_s + 0.2, (waited, last)
    decode.engine.check_idle()


def test_a_prefill_worker_whose_connection_breaks_fails_the_room_at_once(pair):
    prefill, decode = pair
    prefill.progress.pace.s_per_token = 1.0   # each report promises the next only after a 16 s step
    results = {}
    submit(prefill, decode, 3, PROMPT, SamplingParams(max_tokens=4), results, [])
    decode.tick()                             # bootstrapped before P's one step, which then reports first
    drive_slow(prefill, decode, lambda: decode.transfer and decode.receiver.poll(3).progress is not None,
               step_every_s=60.0, prefill_steps=1)
    assert decode.receiver.poll(3).progress.expected_s >= 16.0
    t0 = time.monotonic()
    prefill.sender.close()                    # what a killed prefill worker's socket does
    drive_slow(prefill, decode, lambda: results["r3"], step_every_s=60.0, prefill_steps=0)
    [err] = results["r3"]
    assert isinstance(err, TransferFailed) and "lost" in str(err)
    assert time.monotonic() - t0 < TRANSFER_S
    decode.engine.check_idle()
