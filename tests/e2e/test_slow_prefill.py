"""A slow prefill is not a transfer failure: `tandem up` with a 2 s --transfer-timeout and a prefill
worker that takes several times that (every engine step delayed on purpose), or that hangs."""

from __future__ import annotations

import time

import grpc
import pytest

from tandem.services.prefill.progress import DEFAULT_S_PER_TOKEN, REPORT_INTERVAL_S
from tandem.services.worker.faults import HANG_AT_ENV, HANG_S_ENV
from tests.e2e.stack import Stack, service_env

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]   # ~40 s: prefills stretched on purpose

TRANSFER_S = 2.0
# 32-token chunks: the 150-token prompt takes 5 prefill steps.
ARGS = ("--dtype", "float32", "--page-size", "4", "--chunked-prefill-size", "32", "--max-total-tokens", "4096",
        "--transfer-backend", "tcp", "--transfer-timeout", str(TRANSFER_S), "--retry-max-retries", "0")
PROMPT = list(range(3, 153))


def test_a_prefill_several_times_longer_than_the_transfer_timeout_is_served(tiny_llama):
    # Each step waits 1.5 s first (decode steps too): the prefill takes ~7.5 s, almost 4 timeouts.
    stack = Stack("--model", str(tiny_llama), *ARGS, "--fault-inject", "forward_delay_ms=1500",
                  "--enable-fault-injection")
    try:
        t0 = time.monotonic()
        out = stack.generate(PROMPT, timeout=120, max_tokens=2, ignore_eos=True)
        assert len(out.token_ids) == 2
        assert time.monotonic() - t0 > 3 * TRANSFER_S
        decode = stack.workers("decode")[0]
        assert stack.worker_requests(decode).get("failed", 0) == 0
        assert stack.metric(decode, "tandem_kv_transfer_outlived_timeout_total") == 1
    finally:
        stack.close()


def test_a_hung_prefill_worker_still_fails_the_request_soon_after_the_timeout(tiny_llama):
    # The prefill worker's third step hangs for longer than the request may take: its reports stop.
    env = dict(service_env(), **{HANG_AT_ENV: "3", HANG_S_ENV: "12"})
    stack = Stack("--model", str(tiny_llama), *ARGS, env=env)
    try:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stack.generate(PROMPT, timeout=60, max_tokens=2, ignore_eos=True)
        elapsed = time.monotonic() - t0
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        details = e.value.details()
        # P computes from the router's Prefill on, so its first steps may run before D's Bootstrap: it
        # hangs either after reporting (D names the tokens done) or before its first report.
        assert ("timed out: no progress for" in details and "of 150 prompt tokens done" in details) or \
            "timed out: no progress report for" in details, details
        # D waits the timeout after the last report plus twice the next report that one promised: at
        # most the report interval and a 32-token step priced before any step was measured (50 ms a
        # token). About the fixed timeout's 2 s, and well short of the hang.
        promised = REPORT_INTERVAL_S + 32 * DEFAULT_S_PER_TOKEN
        assert TRANSFER_S < elapsed < TRANSFER_S + 2 * promised + 2.0, elapsed
    finally:
        stack.close()
