"""`--fault-inject`: parsed and refused in one place; transfer faults take the real abort path."""

from __future__ import annotations

import time

import pytest

from tandem.cli.main import build_parser
from tandem.cli.up_cmd import worker_args
from tandem.cli.worker_cmd import fault_config
from tandem.kvtransfer import create_receiver, create_sender
from tandem.kvtransfer.base import RoomState
from tandem.services.worker.fault_sender import FaultySender, sender_options, wrap_sender
from tandem.services.worker.faults import ALLOW_ENV, HANG_AT_ENV, FaultConfig, FaultInjector, FaultSpecError
from tests.kvtransfer.helpers import SMALL, random_pool, uid, wait_done

SPEC = "transfer_fail=0.25,transfer_delay_ms=50,forward_delay_ms=20,seed=7"


def test_spec_is_refused_unless_enabled():
    with pytest.raises(FaultSpecError, match="--enable-fault-injection"):
        FaultConfig.load(SPEC, enabled=False, environ={})
    cfg = FaultConfig.load(SPEC, enabled=True, environ={})
    assert (cfg.transfer_fail, cfg.transfer_delay_ms, cfg.forward_delay_ms, cfg.seed) == (0.25, 50.0, 20.0, 7)
    assert FaultConfig.load(SPEC, enabled=False, environ={ALLOW_ENV: "1"}) == cfg
    assert FaultConfig.load("", enabled=False, environ={HANG_AT_ENV: "3"}).step_hang_at == 3
    assert not FaultConfig.load("", enabled=False, environ={}).any


@pytest.mark.parametrize("bad", ["transfer_fail=1.5", "transfer_fail", "nope=1", "forward_delay_ms=-1",
                                 "transfer_delay_ms=fast", "kv_corrupt=-0.1"])
def test_bad_specs_say_what_is_wrong(bad):
    with pytest.raises(FaultSpecError, match="--fault-inject"):
        FaultConfig.load(bad, enabled=True, environ={})


def test_up_forwards_the_fault_flags_and_workers_parse_them():
    up = build_parser().parse_args(["up", "--fault-inject", SPEC, "--enable-fault-injection",
                                    "--peer-probe-interval", "0.5"])
    worker = build_parser().parse_args(["prefill", *worker_args(up)])
    assert fault_config(worker).transfer_fail == 0.25 and worker.peer_probe_interval == 0.5
    assert "--fault-inject" not in worker_args(build_parser().parse_args(["up"]))


def test_forward_delay_slows_every_step():
    inj = FaultInjector(FaultConfig(forward_delay_ms=30))
    t0 = time.monotonic()
    for _ in range(3):
        inj.before_step()
    assert time.monotonic() - t0 >= 0.09


@pytest.fixture
def pair():
    rx = create_receiver("tcp", SMALL, "127.0.0.1", uid("d"))
    tx = create_sender("tcp", random_pool(SMALL, 1), SMALL, uid("p"))
    tx.connect(rx.worker_id, rx.metadata())
    yield tx, rx
    tx.close()
    rx.close()


def test_no_faults_no_wrapper(pair):
    tx, _ = pair
    assert wrap_sender(tx, FaultConfig(forward_delay_ms=5)) is tx


def test_drawn_rooms_fail_on_both_sides_and_the_rest_succeed(pair):
    tx, rx = pair
    faulty = FaultySender(tx, FaultConfig(transfer_fail=0.5, seed=3))
    outcomes = {}
    for room in range(1, 41):
        pages = [room % 60, room % 60 + 1]
        rx.expect(room, pages, tx.worker_id)
        faulty.write(rx.worker_id, room, [0, 1], pages)
        faulty.finish(rx.worker_id, room, b"aux")
        st = wait_done(lambda room=room: faulty.status(room))
        d = wait_done(lambda room=room: rx.poll(room))
        assert st.state.done and d.state.done and (st.state is RoomState.SUCCESS) == (d.state is RoomState.SUCCESS)
        if st.state is RoomState.FAILED:
            assert "injected transfer failure" in st.error
        outcomes[room] = st.state
        faulty.release(room)
        rx.release(room)
    failed = sum(s is RoomState.FAILED for s in outcomes.values())
    assert 8 <= failed <= 32, failed  # about half, from a fixed seed


def test_delayed_finish_and_abort_cancels_it(pair):
    tx, rx = pair
    faulty = FaultySender(tx, FaultConfig(transfer_delay_ms=300))
    rx.expect(1, [3], tx.worker_id)
    rx.expect(2, [4], tx.worker_id)
    t0 = time.monotonic()
    for room, page in ((1, 3), (2, 4)):
        faulty.write(rx.worker_id, room, [0], [page])
        faulty.finish(rx.worker_id, room, b"aux")
    faulty.abort(2)                                   # the held-back finish of room 2 never goes out
    assert wait_done(lambda: faulty.status(1)).state is RoomState.SUCCESS
    assert time.monotonic() - t0 >= 0.29
    assert wait_done(lambda: rx.poll(2)).state is RoomState.FAILED
    time.sleep(0.4)
    assert faulty.status(2).state is RoomState.FAILED


def test_same_seed_different_workers_draw_differently(pair):
    tx, _ = pair
    cfg = FaultConfig(transfer_fail=0.5, seed=1)
    a, b, a2 = FaultySender(tx, cfg, "p0"), FaultySender(tx, cfg, "p1"), FaultySender(tx, cfg, "p0")
    draws = [[s._fails(room) for room in range(64)] for s in (a, b, a2)]
    assert draws[0] == draws[2] and draws[0] != draws[1]


def test_kv_corrupt_becomes_the_senders_hook_and_drawn_rooms_are_caught():
    """`kv_corrupt=P` reaches the sender only as its `corrupt` option (never through a request): the
    drawn rooms arrive with a byte flipped and the receiver fails exactly those as corrupt."""
    cfg = FaultConfig.load("kv_corrupt=0.5,seed=4", enabled=True, environ={})
    assert cfg.kv_corrupt == 0.5 and cfg.any and not cfg.transfers
    assert sender_options(FaultConfig(transfer_fail=0.5)) == {}
    rx = create_receiver("tcp", SMALL, "127.0.0.1", uid("d"))
    tx = create_sender("tcp", random_pool(SMALL, 1), SMALL, uid("p"), **sender_options(cfg, "p"))
    try:
        tx.connect(rx.worker_id, rx.metadata())
        corrupt = []
        for room in range(1, 41):
            rx.expect(room, [room], tx.worker_id)
            tx.write(rx.worker_id, room, [0], [room])
            tx.finish(rx.worker_id, room, b"aux")
            st = wait_done(lambda room=room: rx.poll(room))
            assert st.state is (RoomState.FAILED if st.corrupt else RoomState.SUCCESS), st
            corrupt.append(st.corrupt)
        assert 5 < sum(corrupt) < 35
    finally:
        tx.close()
        rx.close()
