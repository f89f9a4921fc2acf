"""`tandem up`'s launcher without models: the banner, and startup that gives up on Ctrl-C/SIGTERM."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tandem.services.launcher.procs import Child, stop_all
from tandem.services.launcher.up import (
    UpConfig,
    _banner,
    _Interrupted,
    _wait_ready,
    worker_roles,
    worker_threads,
)

pytestmark = pytest.mark.timeout(30)

SUMMARY = {
    "router": "127.0.0.1:50051", "mode": "disagg", "redis_url": "unix:///tmp/r/redis.sock",
    "router_metrics_port": 9101, "gateway": "http://127.0.0.1:8000",
    "workers": [{"role": "prefill", "worker_id": "prefill-0-1", "grpc_addr": "127.0.0.1:4001", "metrics_port": 9201},
                {"role": "decode", "worker_id": "decode-0-1", "grpc_addr": "127.0.0.1:4002", "metrics_port": 9202}],
}


def test_banner_names_every_endpoint_for_a_person():
    text = _banner(SUMMARY, "0.0.0.0")
    assert text.startswith("Tandem is up (disagg, 2 workers)")
    for url in ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/health", "http://127.0.0.1:8000/metrics",
                "127.0.0.1:50051", "http://127.0.0.1:9101/metrics", "http://127.0.0.1:9201/metrics",
                "http://127.0.0.1:9202/metrics", "curl -s http://127.0.0.1:8000/v1/chat/completions",
                "Ctrl-C stops everything."):
        assert url in text, url
    assert "{" not in text.splitlines()[0] and "TANDEM_UP" not in text
    # what a person pastes answers the same every time (greedy)
    assert '"temperature": 0}' in text and "max_tokens=16, temperature=0)" in text
    no_gateway = _banner({k: v for k, v in SUMMARY.items() if k != "gateway"}, "127.0.0.1")
    assert "HTTP" not in no_gateway and "Try it with the gRPC SDK:" in no_gateway


def test_startup_gives_up_at_once_when_asked_to_stop():
    child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"])
    child.start()
    stop = threading.Event()
    try:
        threading.Timer(0.3, stop.set).start()
        t0 = time.monotonic()
        with pytest.raises(_Interrupted):
            _wait_ready(child, 600.0, stop)
        assert time.monotonic() - t0 < 2.0
    finally:
        stop_all([child], grace_s=5.0)
    assert not child.alive


def test_a_child_that_never_gets_ready_is_an_error_after_its_timeout():
    child = Child("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"])
    child.start()
    try:
        with pytest.raises(RuntimeError, match=r"sleeper did not become ready within \ds \(still running\)"):
            _wait_ready(child, 0.5, threading.Event())
    finally:
        stop_all([child], grace_s=5.0)


def test_a_child_that_dies_at_start_says_so_with_its_exit_code_and_last_lines():
    # What a broken install looked like: `did not become ready within 0s (exit code None)`.
    script = ("import sys; print('loading the model'); print('Traceback (most recent call last):'); "
              "print(\"ImportError: cannot import name 'get_kernel' from 'kernels'\"); sys.exit(3)")
    child = Child("colocated-0", [sys.executable, "-c", script])
    child.start()
    with pytest.raises(RuntimeError) as err:
        _wait_ready(child, 600.0, threading.Event())
    text = str(err.value)
    assert text.startswith("colocated-0 exited with code 3 before it was ready")
    assert "its last lines:\n  loading the model\n  Traceback" in text and "get_kernel" in text


def test_colocated_replicas_split_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert worker_roles(UpConfig(mode="colocated", num_colocated=2)) == [("colocated", 2)]
    assert worker_threads(UpConfig(mode="colocated", num_colocated=2)) == 2
    assert worker_threads(UpConfig(mode="colocated")) == 4
    assert worker_roles(UpConfig(num_prefill=2, num_decode=1)) == [("prefill", 2), ("decode", 1)]
    assert worker_threads(UpConfig(num_prefill=2, num_decode=1)) == 1
