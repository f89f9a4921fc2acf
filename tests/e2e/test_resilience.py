"""Peers and supervision end to end: real processes on 127.0.0.1, faults made with signals."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import time

import grpc
import pytest

from tandem.v1 import generation_pb2
from tests.e2e.stack import Stack

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

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


def _restarted(stack: Stack, name: str, timeout_s: float = 90.0) -> dict:
    """The TANDEM_RESTARTED event of `name` (waits for it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(stack.log):
            if line.startswith("TANDEM_RESTARTED ") and json.loads(line[17:])["name"] == name:
                return json.loads(line[17:])
        time.sleep(0.2)
    raise AssertionError(f"{name} was not restarted:\n" + "\n".join(stack.log))


def test_decode_killed_mid_stream_ends_it_clearly_and_is_restarted(tiny_llama):
    stack = Stack("--model", str(tiny_llama), *ENGINE, "--prefill", "1", "--decode", "1")
    try:
        decode = stack.workers("decode")[0]
        req = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(max_tokens=400, ignore_eos=True))
        req.token_ids.ids.extend(range(3, 30))
        call = stack.stub.Generate(req, timeout=60)
        got = 0
        with pytest.raises(grpc.RpcError) as err:
            for chunk in call:
                got += len(chunk.token_ids)
                if got >= 3 and decode["pid"]:
                    os.kill(decode["pid"], signal.SIGKILL)
                    decode["pid"] = 0
        assert 3 <= got < 400
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # Its only decode worker died: nothing to migrate the stream to (test_decode_killed_mid_stream_...migrated).
        assert "decode worker" in err.value.details() and "no other worker to continue on" in err.value.details()
        event = _restarted(stack, "decode-0")
        assert event["restarts"] == 1 and event["pid"] != stack.workers("decode")[0]["pid"]
        # The new instance serves (under the same worker id, a new boot epoch); the prefill side is clean.
        t0 = time.monotonic()
        while True:
            try:
                assert len(stack.generate([5, 6, 7], timeout=10, max_tokens=3, ignore_eos=True).token_ids) == 3
                break
            except grpc.RpcError:
                assert time.monotonic() - t0 < 30, "the restarted decode worker never served"
                time.sleep(0.3)
        free, total = stack.wait_pages_free(stack.workers("prefill")[0])
        assert free == total
        assert "decode-0 exited (killed by SIGKILL); restarting it" in "\n".join(stack.log)
    finally:
        stack.close()


def _streams_through(stack: Stack, prompts: list[list[int]], max_tokens: int, fault) -> tuple[list[list[int]], list[float]]:
    """Stream every prompt at once; run `fault()` once every stream has 3 tokens (and none is done).
    Returns each stream's tokens and the longest gap between two of its chunks."""
    progress = [0] * len(prompts)
    gaps = [0.0] * len(prompts)

    def stream(i: int) -> list[int]:
        req = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                      temperature=0, ignore_eos=True))
        req.token_ids.ids.extend(prompts[i])
        got, last = [], time.monotonic()
        for chunk in stack.stub.Generate(req, timeout=120):
            now = time.monotonic()
            gaps[i], last = max(gaps[i], now - last), now
            got += chunk.token_ids
            progress[i] = len(got)
        return got

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(prompts))]
        t0 = time.monotonic()
        while min(progress) < 3:
            assert time.monotonic() - t0 < 60, progress
            time.sleep(0.01)
        fault()
        assert max(progress) < max_tokens
        return [f.result() for f in futures], gaps


def test_decode_killed_mid_stream_every_stream_is_migrated_and_matches_an_undisturbed_run(tiny_llama):
    # Steps slowed so that every stream is surely mid-output when the worker dies.
    stack = Stack("--model", str(tiny_llama), *ENGINE, "--prefill", "1", "--decode", "2",
                  "--enable-fault-injection", "--fault-inject", "forward_delay_ms=15")
    try:
        prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(8)]
        want = [list(stack.generate(p, max_tokens=120, ignore_eos=True).token_ids) for p in prompts]
        victim = stack.workers("decode")[0]
        got, _ = _streams_through(stack, prompts, 120, lambda: os.kill(victim["pid"], signal.SIGKILL))
        assert got == want  # every stream completed: no token twice, none missing, the same greedy tokens
        router = {"metrics_port": stack.info["router_metrics_port"]}
        assert stack.metric(router, 'tandem_router_migrations_total{outcome="migrated"}') >= 1
    finally:
        stack.close()


def test_frozen_decode_worker_is_noticed_within_the_keepalive_bound_and_its_streams_migrate(tiny_llama):
    """SIGSTOP: the worker's host still answers TCP (the kernel ACKs), nothing above it does. Without
    gRPC keepalive its streams would wait as long as the client does; with it the router gives the
    connection up within keepalive.DETECT_BOUND_S and migrates every stream, text unchanged."""
    from tandem.services.common.keepalive import DETECT_BOUND_S

    stack = Stack("--model", str(tiny_llama), *ENGINE, "--prefill", "1", "--decode", "2",
                  "--enable-fault-injection", "--fault-inject", "forward_delay_ms=15", "--max-restarts", "0")
    victim = stack.workers("decode")[0]
    try:
        prompts = [list(range(5 + i, 22 + 2 * i)) for i in range(6)]
        want = [list(stack.generate(p, max_tokens=100, ignore_eos=True).token_ids) for p in prompts]
        got, gaps = _streams_through(stack, prompts, 100, lambda: os.kill(victim["pid"], signal.SIGSTOP))
        assert got == want
        router = {"metrics_port": stack.info["router_metrics_port"]}
        assert stack.metric(router, 'tandem_router_migrations_total{outcome="migrated"}') >= 1
        # The longest wait of any stream: detection, then the continuation's prefill on the other pair.
        assert max(gaps) < DETECT_BOUND_S + 5, gaps
    finally:
        os.kill(victim["pid"], signal.SIGCONT)
        stack.close()
