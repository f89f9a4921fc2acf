"""A real co-located worker process: the watchdog on an injected hang (and not under normal load),
and a full queue turning away the right request with RESOURCE_EXHAUSTED and a message saying why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque

import grpc
import pytest

from tandem.services.worker.faults import HANG_AT_ENV, HANG_S_ENV
from tandem.services.worker.watchdog import EXIT_CODE
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.e2e.stack import ROOT, Service

pytestmark = pytest.mark.timeout(180)


class Worker(Service):
    """`tandem colocated` with extra environment; talks Generation directly (no router)."""

    def __init__(self, model, *args: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "tandem.cli", "colocated", "--model", str(model), "--dtype", "float32",
             "--page-size", "4", "--max-total-tokens", "2048", "--context-length", "256", "--metrics-port", "-1",
             "--log-stats-interval", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        self.log: deque[str] = deque(maxlen=2000)
        self.info = None
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        self.wait_ready(120)
        self.channel = grpc.insecure_channel(self.info["grpc_addr"])
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def stream(self, rid: str, priority: int = 0, max_tokens: int = 8):
        return self.stub.Generate(pb.GenerateRequest(
            request_id=rid, token_ids=pb.TokenIds(ids=[5, 6, 7, 8, 9]), priority=priority,
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)), timeout=60)

    def text(self) -> str:
        return "\n".join(self.log)


def test_watchdog_dumps_stacks_and_exits_on_a_hung_step(tiny_llama):
    w = Worker(tiny_llama, "--watchdog-timeout", "1.5", env={HANG_AT_ENV: "3", HANG_S_ENV: "60"})
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError):
            list(w.stream("r", max_tokens=20))  # step 3 never finishes: the worker dies under it
        assert w.proc.wait(30) == EXIT_CODE
        assert time.monotonic() - t0 < 30
        log = w.text()
        assert "watchdog: engine step 3 has not finished after 1.5s" in log
        # Every thread's stack, the hung engine thread's included, down to where it hangs.
        assert "Thread engine" in log and "Thread watchdog" in log and "in before_step" in log
    finally:
        w.close()


def test_watchdog_stays_quiet_under_normal_load(tiny_llama):
    w = Worker(tiny_llama, "--watchdog-timeout", "5")
    try:
        results = [None] * 8

        def run(i):
            results[i] = [c for c in w.stream(f"r{i}", max_tokens=24)]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(r and r[-1].finish_reason == pb.FINISH_REASON_LENGTH for r in results)
        time.sleep(6)  # idle for longer than the timeout: an idle worker is not a hung one
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(30) == 0
        assert "watchdog" not in w.text()
    finally:
        w.close()


def test_full_queue_rejects_the_lowest_priority_with_resource_exhausted(tiny_llama):
    # One slot, one queue place; step 3 stalls for 3 s so that the next three requests arrive while
    # "running" holds the slot, and are taken in their arrival order once the engine wakes up.
    w = Worker(tiny_llama, "--max-running-requests", "1", "--max-queued-requests", "1",
               "--enable-priority-scheduling", "--priority-preemption-threshold", "1000",
               env={HANG_AT_ENV: "3", HANG_S_ENV: "3"})
    try:
        running = w.stream("running", priority=0, max_tokens=12)
        next(running)  # prefilled: it holds the only slot
        low = w.stream("low", priority=1)
        time.sleep(0.3)
        high = w.stream("high", priority=5)
        time.sleep(0.3)
        late = w.stream("late", priority=1)
        with pytest.raises(grpc.RpcError) as e:
            list(low)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "higher priority (5) arrived and this one (1) was the lowest" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(late)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "waiting queue is full (1 requests, --max-queued-requests)" in e.value.details()
        assert "no queued request has a lower priority than this one (1)" in e.value.details()
        assert list(high)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert list(running)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(30) == 0  # the idle self-check passed: nothing leaked
        assert "leak" not in w.text().lower()
    finally:
        w.close()
