"""KV events in a live deployment (`tandem up`, embedded Redis, two co-located workers): each worker
publishes its prefix cache's blocks, the router's view of both is exact, and a prompt served once
shows up as applied events on the router."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from tests.e2e.stack import Stack

pytestmark = pytest.mark.timeout(180)

ENGINE = ("--dtype", "float32", "--page-size", "4", "--max-total-tokens", "1024")


def router_metric(stack: Stack, name: str) -> float:
    port = stack.info["router_metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_workers_publish_and_the_router_is_exact(tiny_llama):
    stack = Stack("--mode", "colocated", "--colocated", "2", "--model", str(tiny_llama), *ENGINE)
    try:
        wait_for(lambda: router_metric(stack, "tandem_router_kv_exact_workers") == 2)
        prompt = list(range(5, 45))
        stack.generate(prompt, max_tokens=2, temperature=0)
        wait_for(lambda: router_metric(stack, "tandem_router_kv_events_applied_total") >= 9)
        published = sum(stack.metric(w, "tandem_kv_events_published_total") for w in stack.workers("colocated"))
        assert published >= 9          # the prompt's full pages (and more) entered one worker's L1
        assert router_metric(stack, "tandem_router_kv_exact_workers") == 2
    finally:
        stack.close()
