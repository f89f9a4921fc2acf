"""`tandem up`'s launcher without models: the banner, and startup that gives up on Ctrl-C/SIGTERM."""

from __future__ import annotations

import glob
import sys
import threading
import time

import pytest

from tandem.services.launcher.procs import Child, stop_all
from tandem.services.launcher.up import (
    UpConfig,
    _banner,
    _Interrupted,
    _printer,
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


STUCK = """
import faulthandler, os, signal, sys, threading, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)          # a stop that hangs
faulthandler.register(signal.SIGUSR1, all_threads=True)
path = f"/dev/shm/tandem-kv-stuck_0-{os.getpid()}-{sys.argv[1]}"
open(path, "wb").close()                                # a KV segment it would remove on a clean stop
def waits_forever():
    threading.Event().wait()
threading.Thread(target=waits_forever, name="engine").start()
print("up", flush=True)
time.sleep(60)
"""


def test_a_worker_that_will_not_stop_says_where_it_hangs_and_its_shared_memory_is_removed(tmp_path, caplog):
    tag = tmp_path.name[-12:].replace("_", "")
    child = Child("decode-0", [sys.executable, "-c", STUCK, tag])   # no on_line: as under --quiet
    child.start()
    segment = f"/dev/shm/tandem-kv-stuck_0-{child.proc.pid}-{tag}"
    deadline = time.monotonic() + 10
    while "up" not in child.tail and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "up" in child.tail and glob.glob(segment)
    with caplog.at_level("WARNING", logger="tandem.services.launcher.procs"):
        stop_all([child], grace_s=0.5)
    assert not child.alive
    assert "decode-0 did not stop within 0s: killing it" in caplog.text
    assert "waits_forever" in caplog.text, caplog.text   # the stuck thread's stack, in the launcher's log
    assert not glob.glob(segment)


def test_quiet_keeps_the_services_warnings_with_their_continuation_lines(capsys):
    on_line = _printer(quiet=True)
    lines = ['TANDEM_READY {"role": "decode"}',
             "2026-12-05 09:12:30,001 INFO tandem.services.worker.server: decode d-1 serving",
             "  an INFO record's second line",
             "2026-12-05 09:12:33,739 WARNING tandem.services.worker.server: decode d-1: stopping, the drain took 11.0s",
             'Thread 0x7f (most recent call first):', '  File "loop.py", line 3 in _run',
             "2026-12-05 09:12:34,000 INFO tandem.services.worker.server: decode d-1 stopped"]
    for line in lines:
        on_line("decode-0", line)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"[decode-0] {line}" for line in (lines[0], *lines[3:6])]
    on_line("prefill-0", "Traceback (most recent call last):")   # not a record: a crash before logging
    assert capsys.readouterr().err == "[prefill-0] Traceback (most recent call last):\n"


def test_a_niced_command_runs_at_that_niceness_under_its_own_pid():
    import os
    import subprocess

    from tandem.services.launcher.procs import niced
    from tandem.services.launcher.redis_server import EmbeddedRedis

    code = "import os; print(os.getpid(), os.nice(0) - int(os.environ['PARENT_NICE']))"
    p = subprocess.Popen(niced([sys.executable, "-c", code], 7), stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PARENT_NICE": str(os.nice(0))})
    pid, nice = p.communicate(timeout=30)[0].split()
    assert int(pid) == p.pid and int(nice) == 7        # `nice` exec'd the command: the pid tandem up supervises
    assert niced(["x"], 0) == ["x"]
    redis = EmbeddedRedis(niceness=5)
    child = redis.start()
    try:
        with open(f"/proc/{child.proc.pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[16]) - os.nice(0) == 5
    finally:
        redis.close()
