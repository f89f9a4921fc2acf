"""A live reshape under load (issue [19], acting on one host): a 1P1D `tandem up` serving a steady
stream of concurrent greedy streams is moved to 0P2D (the prefill worker drains and comes back as a
decode worker on its cores) and back to 1P1D by `tandem reshape`; no request fails, every output is
the undisturbed run's, and the launcher reports the shape it runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.e2e.stack import ROOT, Stack, service_env

pytestmark = pytest.mark.timeout(600)

PROMPTS = [list(range(5 + 7 * i, 45 + 7 * i)) for i in range(8)]
MAX_TOKENS = 12


def reshape(stack: Stack, shape: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "tandem.cli", "reshape", shape, "--redis-url",
                           stack.info["redis_url"], "--reason", "e2e", "--wait-timeout", str(timeout_s)],
                          capture_output=True, text=True, cwd=ROOT, env=service_env(), timeout=timeout_s + 30)


@pytest.mark.slow   # ~60 s: make test-slow (CI runs it); the reshape state machine's unit tests run in make test
def test_reshape_to_0p2d_and_back_under_load_fails_no_request(tiny_llama):
    stack = Stack("--model", str(tiny_llama), "--dtype", "float32", "--page-size", "4", "--transfer-backend", "tcp",
                  "--prefill", "1", "--decode", "1", "--min-prefill-workers", "0", "--drain-timeout", "30",
                  gateway=True)
    try:
        expected = [list(stack.generate(p, max_tokens=MAX_TOKENS, ignore_eos=True).token_ids) for p in PROMPTS]
        stop = threading.Event()
        done: list[tuple[int, list[int]]] = []
        failed: list[str] = []

        def client(k: int) -> None:
            i = k
            while not stop.is_set():
                try:
                    out = stack.generate(PROMPTS[i % len(PROMPTS)], 120.0, max_tokens=MAX_TOKENS, ignore_eos=True)
                    done.append((i % len(PROMPTS), list(out.token_ids)))
                except Exception as e:   # any failed request fails the test
                    failed.append(f"{type(e).__name__}: {e}")
                i += 1

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        try:
            time.sleep(2.0)
            refused = reshape(stack, "2P1D", 10)
            assert refused.returncode == 2
            assert "2P1D needs 3 workers, but this deployment has 2 worker slots" in refused.stderr

            before = len(done)
            to_colocated = reshape(stack, "0P2D")
            assert to_colocated.returncode == 0, to_colocated.stderr + "\n".join(stack.log)
            state = json.loads(to_colocated.stdout)
            assert state["shape"] == "0P2D" and not state["busy"] and state["error"] is None
            assert [(s["role"], s["name"], s["state"]) for s in state["slots"]] == [
                ("decode", "decode-1", "serving"), ("decode", "decode-0", "serving")]
            # Ready with decode workers only: the gateway's /health asks the router's.
            with urllib.request.urlopen(f"{stack.gateway_url}/health", timeout=5) as resp:
                assert resp.status == 200
            time.sleep(2.0)              # served as two co-located replicas for a while
            served_0p2d = len(done)

            back = reshape(stack, "1P1D")
            assert back.returncode == 0, back.stderr + "\n".join(stack.log)
            state = json.loads(back.stdout)
            time.sleep(2.0)
        finally:
            stop.set()
            for t in threads:
                t.join(150)
        assert not failed, failed[:5]
        assert served_0p2d > before and len(done) > served_0p2d   # requests ran through every phase
        assert all(tokens == expected[i] for i, tokens in done), [
            (i, tokens, expected[i]) for i, tokens in done if tokens != expected[i]][:3]
        assert state["shape"] == "1P1D" and not state["busy"] and state["seq"] >= 2
        assert sorted(s["role"] for s in state["slots"]) == ["decode", "prefill"]
        prefill = [s for s in state["slots"] if s["role"] == "prefill"]
        assert prefill[0]["name"] == "prefill-1"   # a new worker, a name (and worker id) never used before
        # The drained workers left the Supervisor's care: exit code 0, never restarted.
        assert not any("restarting it" in line for line in stack.log), "\n".join(stack.log)
        # The new prefill worker serves: the next prompt goes through it (remote route).
        assert list(stack.generate(PROMPTS[0], max_tokens=MAX_TOKENS, ignore_eos=True).token_ids) == expected[0]
    finally:
        stack.close()


@pytest.mark.slow
def test_a_deployment_may_start_without_prefill_workers_and_gain_one(tiny_llama):
    stack = Stack("--model", str(tiny_llama), "--dtype", "float32", "--page-size", "4", "--transfer-backend", "tcp",
                  "--prefill", "0", "--decode", "2", "--min-prefill-workers", "0")
    try:
        assert sorted(w["role"] for w in stack.info["workers"]) == ["decode", "decode"]
        first = list(stack.generate(PROMPTS[1], max_tokens=MAX_TOKENS, ignore_eos=True).token_ids)
        assert len(first) == MAX_TOKENS
        moved = reshape(stack, "1P1D")
        assert moved.returncode == 0, moved.stderr + "\n".join(stack.log)
        state = json.loads(moved.stdout)
        assert state["shape"] == "1P1D" and state["last_move"]["to"] == "prefill-0"
        assert list(stack.generate(PROMPTS[1], max_tokens=MAX_TOKENS, ignore_eos=True).token_ids) == first
    finally:
        stack.close()
