"""SIGTERM to a prefill worker while it owes KV transfers: it leaves routing, finishes what it holds,
and exits; no request is lost (every one gets all its tokens)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import time
import urllib.request

import pytest

from tests.e2e.stack import Stack

pytestmark = pytest.mark.timeout(300)


def outstanding(worker: dict) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker['metrics_port']}/metrics", timeout=5).read().decode()
    return float(re.search(r"^tandem_kv_transfers_outstanding (\S+)$", text, re.M).group(1))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_to_a_prefill_worker_with_transfers_in_flight_loses_no_request(tiny_llama):
    # Long prompts in 16-token chunks keep each room's transfer open across many steps; a small KV
    # pool on D makes rooms queue, so the victim holds both owed transfers and bootstrapping rooms.
    stack = Stack("--model", str(tiny_llama), "--dtype", "float32", "--page-size", "4",
                  "--chunked-prefill-size", "16", "--max-total-tokens", "1024", "--transfer-backend", "tcp",
                  "--prefill", "2", "--decode", "1", "--drain-timeout", "30")
    try:
        victim = stack.workers("prefill")[0]
        prompts = [list(range(3 + i, 203 + i)) for i in range(12)]
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(stack.generate, p, 60.0, max_tokens=24, ignore_eos=True) for p in prompts]
            deadline = time.monotonic() + 20
            while outstanding(victim) < 1:
                assert time.monotonic() < deadline, "the victim never owed a transfer"
                time.sleep(0.005)
            os.kill(victim["pid"], 15)
            t_term = time.monotonic()
            results = [len(f.result().token_ids) for f in futures]   # raises if any request failed
        assert results == [24] * len(prompts)
        while alive(victim["pid"]) and time.monotonic() - t_term < 35:
            time.sleep(0.05)
        assert not alive(victim["pid"]), "the drained worker did not exit within its drain timeout"
        # The launcher reports its exit code (it polls its children every 0.5 s).
        deadline = time.monotonic() + 5
        while not any(re.search(r"prefill-0 exited \(code 0\)", line) for line in stack.log):
            assert time.monotonic() < deadline, "\n".join(stack.log)
            time.sleep(0.1)
        # The rest keep serving, and nothing leaked on the decode side.
        assert len(stack.generate(list(range(10, 30)), max_tokens=5, ignore_eos=True).token_ids) == 5
        decode = stack.workers("decode")[0]
        free, total = stack.wait_pages_free(decode, timeout_s=20)
        assert free == total
        # Load under the names a Gateway API Inference Extension endpoint picker scrapes.
        text = urllib.request.urlopen(f"http://127.0.0.1:{decode['metrics_port']}/metrics", timeout=5).read().decode()
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert re.search(rf'^{name}{{model_name="[^"]+"}} 0\.0$', text, re.M), name
    finally:
        stack.close()
