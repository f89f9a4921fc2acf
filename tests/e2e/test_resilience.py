"""Peers and supervision end to end: real processes on 127.0.0.1, faults made with signals."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest

from tests.e2e.stack import Stack

pytestmark = pytest.mark.timeout(300)

ENGINE = ("--dtype", "float32", "--page-size", "4", "--max-total-tokens", "4096", "--transfer-backend", "tcp")


def test_a_stopped_prefill_worker_fails_only_its_rooms_and_they_are_retried(tiny_llama):
    # Timeouts far above what the test allows: only the liveness probe can free the rooms in time.
    stack = Stack("--model", str(tiny_llama), *ENGINE, "--prefill", "2", "--decode", "1",
                  "--bootstrap-timeout", "120", "--transfer-timeout", "120", "--peer-probe-interval", "0.5")
    victim = stack.workers("prefill")[0]
    decode = stack.workers("decode")[0]
    try:
        assert len(stack.generate([5, 6, 7], max_tokens=2, ignore_eos=True).token_ids) == 2
        os.kill(victim["pid"], signal.SIGSTOP)   # alive to the kernel, connections open, serving nothing
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(stack.generate, list(range(3 + i, 20 + i)), 60.0, max_tokens=4, ignore_eos=True)
                       for i in range(6)]
            outs = [len(f.result().token_ids) for f in futures]
        assert outs == [4] * 6                   # the rooms on the stopped worker failed and were retried
        assert time.monotonic() - t0 < 40
        assert stack.worker_requests(decode).get("failed", 0) >= 1
        free, total = stack.wait_pages_free(decode)
        assert free == total, f"decode worker leaked pages: {free}/{total}"
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
        stack.close()
