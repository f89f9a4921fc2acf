"""Tandem as a cluster on one box (`make test-cluster`): Redis, the router with the gateway, and every
worker on a host of its own (network namespaces on a bridge, tandem.bench.cluster). Needs root.

Greedy fp32 text across hosts equals the co-located stack's on loopback, on every transfer backend
that crosses hosts (auto must pick tcp there: the hosts have their own /dev/shm and hostname), and a
decode host cut off the network mid-stream is noticed within the keepalive bound; its streams continue
on the other decode host with the same text."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import httpx
import pytest

from tandem.services.common.keepalive import DETECT_BOUND_S

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

if os.geteuid() != 0:
    pytest.skip("network namespaces need root", allow_module_level=True)

from tandem.bench.cluster.deploy import Cluster  # noqa: E402
from tandem.bench.cluster.net import Network, namespaces  # noqa: E402
from tests.e2e.stack import Stack  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):"]
WORKER = ("--dtype", "float32", "--kv-cache-gb", "0.25")
# Every prompt goes through a prefill worker (the tests are about the KV crossing hosts).
REMOTE = ("--local-prefill-max-tokens", "-1")


def complete(url: str, prompt: str, max_tokens: int = 24) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=180,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def colocated() -> dict[str, str]:
    """The reference: a co-located stack on loopback, the same model and dtype."""
    stack = Stack("--mode", "colocated", "--model", "smollm2-135m", *WORKER, gateway=True, timeout_s=300)
    try:
        return {p: complete(stack.gateway_url, p) for p in PROMPTS}
    finally:
        stack.close()


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of `name`'s samples whose labels contain `labels` (e.g. 'outcome="migrated"')."""
    text = httpx.get(url, timeout=10).text
    return sum(float(m.group(2)) for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)
               if labels in (m.group(1) or ""))


@pytest.mark.parametrize("backend,prefill,decode", [("auto", 1, 1), ("tcp", 2, 2), ("ucx", 1, 1), ("nixl", 1, 1)])
def test_greedy_text_across_hosts_equals_colocated(colocated, backend, prefill, decode, tmp_path):
    with Network(f"g{backend[:4]}") as net:
        with Cluster(net, prefill=prefill, decode=decode, worker_args=(*WORKER, "--transfer-backend", backend),
                     router_args=REMOTE, log_dir=tmp_path) as c:
            for _ in range(max(prefill, decode)):     # every pair gets prompts (round robin by load)
                got = {p: complete(c.gateway_url, p) for p in PROMPTS}
                assert got == colocated
            links = [line for name in c.worker_names("prefill") for line in c.logs[name] if "KV link to" in line]
            assert links, "no prefill worker opened a KV link"
            expected = "tcp" if backend in ("auto", "tcp") else backend
            assert all(f" over {expected}" in line for line in links), links
            if backend == "auto":   # it tried shm first and saw another host
                assert all("shm segment is on host" in line for line in links), links
    assert not namespaces(net.bridge)


def stream(url: str, prompt: str, max_tokens: int, out: dict, key: str, progress: dict | None = None) -> None:
    """One streamed completion; records its text and the longest gap between chunks (and, in
    `progress[key]`, the chunks so far)."""
    text, last, gap = [], time.monotonic(), 0.0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                text.append(chunk["choices"][0]["text"])
                if progress is not None:
                    progress[key] = len(text)
        out[key] = {"text": "".join(text), "max_gap_s": gap}
    except Exception as e:  # noqa: BLE001 - the test reports it
        out[key] = {"error": f"{type(e).__name__}: {e}", "text": "".join(text)}


def test_partitioned_decode_host_streams_continue_elsewhere(tmp_path):
    prompts = [f"{p} (stream {i})" for i, p in enumerate(PROMPTS * 2)]
    with Network("part") as net:
        with Cluster(net, prefill=1, decode=2, worker_args=WORKER, router_args=REMOTE, log_dir=tmp_path) as c:
            undisturbed: dict = {}
            threads = [threading.Thread(target=stream, args=(c.gateway_url, p, 96, undisturbed, p)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all("error" not in v for v in undisturbed.values()), undisturbed

            disturbed: dict = {}
            progress = dict.fromkeys(prompts, 0)
            threads = [threading.Thread(target=stream, args=(c.gateway_url, p, 96, disturbed, p, progress))
                       for p in prompts]
            for t in threads:
                t.start()
            running = 'tandem_requests_running'
            deadline = time.monotonic() + 60
            # Every stream under way, and some of them on decode-0.
            while min(progress.values()) < 2 or metric(c.worker_metrics_url("decode-0"), running) < 1:
                assert time.monotonic() < deadline and max(progress.values()) < 80, progress
                time.sleep(0.05)
            cut = time.monotonic()
            net.partition("decode-0")
            for t in threads:
                t.join(max(0.0, cut + 45 - time.monotonic()))
            took = time.monotonic() - cut
            hung = {p: progress[p] for p, t in zip(prompts, threads, strict=True) if t.is_alive()}
            if hung:
                moved = metric(c.router_metrics_url(), "tandem_router_migrations_total", 'outcome="migrated"')
                where = c.diagnose(tmp_path / "hung")
                for t in threads:
                    t.join(max(0.0, cut + 120 - time.monotonic()))
                late = {p: round(disturbed[p].get("max_gap_s", -1), 1) if p in disturbed else "never"
                        for p in hung}
                pytest.fail(f"streams hung 45 s after the cut (chunks received then): {hung}; migrated: {moved}; "
                            f"their longest gap, if they ended within 120 s: {late}; diagnostics in {where}")
            errors = {k: v for k, v in disturbed.items() if "error" in v}
            assert not errors, errors
            assert {k: v["text"] for k, v in disturbed.items()} == {k: v["text"] for k, v in undisturbed.items()}
            # The longest silence any stream saw: the keepalive bound plus the continuation's prefill.
            worst = max(v["max_gap_s"] for v in disturbed.values())
            assert worst < DETECT_BOUND_S + 10, f"a stream waited {worst:.1f}s (all done {took:.1f}s after the cut)"
            migrated = metric(c.router_metrics_url(), "tandem_router_migrations_total", 'outcome="migrated"')
            assert migrated >= 1

            # Healed, the host is re-admitted without a restart and serves again.
            net.heal("decode-0")
            served_before = metric(c.worker_metrics_url("decode-0"), "tandem_worker_requests_total")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for p in PROMPTS * 2:
                    complete(c.gateway_url, p, max_tokens=4)
                if metric(c.worker_metrics_url("decode-0"), "tandem_worker_requests_total") > served_before:
                    break
            else:
                pytest.fail("decode-0 served nothing within 60 s of being healed")
    assert not namespaces(net.bridge)
