"""`tandem up` as a person runs it: progress, a banner only once a request would be served, no raw
JSON, the router's metrics port, and a clear goodbye on Ctrl-C that leaves nothing behind."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tandem.services.common.cpu_cores import available_cores, describe, plan_cores
from tests.e2e.stack import ROOT, shm_segments_of

pytestmark = pytest.mark.timeout(120)


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line.rstrip("\n"))
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def read_until(q: queue.Queue, pattern: str, seen: list[str], timeout_s: float = 90.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(seen))


def test_up_banner_comes_once_serving_and_ctrl_c_says_goodbye(tiny_llama):
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "tandem.cli", "up", "--port", "0", "--gateway-port", "0", "--model", str(tiny_llama),
         "--dtype", "float32", "--max-total-tokens", "1024", "--transfer-backend", "shm"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True)
    seen: list[str] = []
    try:
        q = lines_of(proc)
        read_until(q, r"^Starting Tandem \(disagg\)", seen)
        plan = plan_cores("auto", available_cores(), 2)
        placement = describe(plan, ["prefill-0", "decode-0"], plan.services_nice(10))   # --services-nice's default
        read_until(q, "^CPU placement: " + re.escape(placement) + "$", seen)
        read_until(q, r"^\[gateway\] ready$", seen)
        read_until(q, r"^Tandem is up \(disagg, 2 workers\):", seen)
        # Up means served: the gateway already answers /health (router and both roles reachable).
        api = read_until(q, r"OpenAI HTTP API", seen)
        url = re.search(r"(http://\S+)/v1", api).group(1)
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.status == 200
        router_metrics = read_until(q, r"^  router metrics", seen)
        with urllib.request.urlopen(router_metrics.split()[-1], timeout=5) as r:
            assert b"tandem_router" in r.read()
        read_until(q, r"^  CPU placement     " + re.escape(placement) + "$", seen)
        read_until(q, r"^Ctrl-C stops everything\.$", seen)
        assert not any("TANDEM_UP" in line or "TANDEM_READY" in line for line in seen)

        proc.send_signal(signal.SIGINT)
        read_until(q, r"^Stopping Tandem \(SIGINT\)", seen, timeout_s=10)
        read_until(q, r"^Tandem stopped\.$", seen, timeout_s=30)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
    assert shm_segments_of(proc.pid) == []
