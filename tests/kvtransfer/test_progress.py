"""PROGRESS reports between a sender and a receiver in this process (tcp; every backend: test_conformance)."""

from __future__ import annotations

import json
import random
import time

import pytest

from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.base import Progress, RoomState
from tests.kvtransfer.helpers import SMALL, random_pool, uid, wait_done, wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    rx_id, tx_id = uid("D"), uid("P")
    rx = create_receiver("tcp", SMALL, "127.0.0.1", rx_id)
    tx = create_sender("tcp", random_pool(SMALL, 1), SMALL, tx_id)
    yield rx, tx, rx_id, tx_id
    tx.close()
    rx.close()


def _report(done: int, expected_s: float = 0.5) -> Progress:
    return Progress(tokens_done=done, tokens_total=100, queued_ahead=7, expected_s=expected_s)


def test_the_latest_report_reaches_the_receiver_stamped_with_its_arrival(pair):
    rx, tx, rx_id, tx_id = pair
    tx.connect(rx_id, rx.metadata())
    room = random.getrandbits(63)
    rx.expect(room, [3, 4], tx_id)
    assert rx.poll(room).progress is None
    before = time.monotonic()
    tx.progress(rx_id, room, _report(16))
    assert wait_until(lambda: rx.poll(room).progress is not None)
    first = rx.poll(room).progress
    assert (first.tokens_done, first.tokens_total, first.queued_ahead, first.expected_s) == (16, 100, 7, 0.5)
    assert before <= first.at <= time.monotonic()
    tx.progress(rx_id, room, _report(48, expected_s=2.0))
    assert wait_until(lambda: rx.poll(room).progress.tokens_done == 48)
    assert rx.poll(room).progress.at >= first.at and rx.poll(room).progress.expected_s == 2.0
    # Reports do not disturb the transfer itself.
    tx.write(rx_id, room, [1, 2], [3, 4])
    tx.finish(rx_id, room, b"aux")
    assert wait_done(lambda: rx.poll(room)).state == RoomState.SUCCESS
    assert rx.progress_reports == 2


def test_a_report_from_another_sender_or_for_a_done_room_is_ignored(pair):
    rx, tx, rx_id, tx_id = pair
    tx.connect(rx_id, rx.metadata())
    theirs, aborted = random.getrandbits(63), random.getrandbits(63)
    rx.expect(theirs, [5], "someone-else")
    rx.expect(aborted, [6], tx_id)
    rx.abort(aborted)
    tx.progress(rx_id, theirs, _report(1))
    tx.progress(rx_id, aborted, _report(1))
    # A frame sent after those two lands after them: once it is in, they were handled.
    mine = random.getrandbits(63)
    rx.expect(mine, [7], tx_id)
    tx.progress(rx_id, mine, _report(2))
    assert wait_until(lambda: rx.poll(mine).progress is not None)
    assert rx.poll(theirs).progress is None and rx.poll(aborted).progress is None
    assert tx.has_peer(rx_id)                   # ignored quietly: the connection stays


def test_no_report_goes_to_a_receiver_that_does_not_take_them(pair):
    rx, tx, rx_id, tx_id = pair
    meta = json.loads(rx.metadata())
    del meta["progress"]                        # what a receiver from before PROGRESS advertises
    tx.connect(rx_id, json.dumps(meta).encode())
    room = random.getrandbits(63)
    rx.expect(room, [3], tx_id)
    tx.progress(rx_id, room, _report(1))
    tx.write(rx_id, room, [1], [3])
    tx.finish(rx_id, room, b"aux")
    assert wait_done(lambda: rx.poll(room)).state == RoomState.SUCCESS
    assert rx.poll(room).progress is None and rx.progress_reports == 0


def test_reports_never_raise_and_a_lost_connection_fails_the_room_at_once(pair):
    rx, tx, rx_id, tx_id = pair
    tx.progress("never-connected", 1, _report(1))  # unknown peer: dropped
    tx.connect(rx_id, rx.metadata())
    room = random.getrandbits(63)
    rx.expect(room, [3], tx_id)
    tx.progress(rx_id, room, _report(10, expected_s=60.0))
    assert wait_until(lambda: rx.poll(room).progress is not None)
    tx.close()                                   # P is gone: its promise of another report is void
    st = wait_done(lambda: rx.poll(room), timeout=5)
    assert st.state == RoomState.FAILED and "lost" in st.error
    tx.progress(rx_id, room, _report(11))        # after close: dropped, no error
