"""bench/tracing_overhead.py's report: medians per mode and on/off - 1 against the target."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.bench.tracing_overhead import cpu_used, role, run_order, stack_cpu, summary, tracing_samples


def run(traced: bool, ttft: float, tpot: float, cpu: float = 10.0) -> dict:
    return {"traced": traced, "ttft_p50": ttft, "ttft_p99": 2 * ttft, "tpot_p50": tpot, "tpot_p99": 2 * tpot,
            "cpu_ms_per_request": cpu}


def test_overhead_is_on_over_off_medians():
    runs = [run(False, 100, 50), run(True, 101, 50.5), run(False, 102, 50), run(True, 103, 51.0)]
    s = summary(runs, 0.02)
    assert s["median"]["off"]["ttft_p50"] == 101 and s["median"]["on"]["ttft_p50"] == 102
    assert s["overhead"]["tpot_p50"] == pytest.approx(0.015)
    assert s["met"]
    assert not summary([run(False, 100, 50), run(True, 110, 50)], 0.02)["met"]
    assert summary([run(False, 100, 50, cpu=10), run(True, 100, 50, cpu=10.5)], 0.02)["overhead"][
        "cpu_ms_per_request"] == pytest.approx(0.05)


def test_processes_are_named_by_their_role_in_the_stack():
    py = "/venv/bin/python"
    assert role([py, "-P", "-m", "tandem.cli", "worker", "--role", "prefill", "--port", "1"], "python") == "worker:prefill"
    assert role([py, "-P", "-m", "tandem.cli", "router", "--port", "1"], "python") == "router"
    assert role([py, "-P", "-m", "tandem.services.gateway", "--port", "1"], "python") == "gateway"
    assert role(["/x/redis-server", "*:0"], "redis-server") == "redis-server"


def test_stack_cpu_counts_the_children_of_the_leader():
    burn = ("import sys, time\nsys.stdin.readline()\nt = time.process_time()\n"
            "while time.process_time() - t < 0.3: pass\nprint(1, flush=True)\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = stack_cpu(os.getpid())
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "1"   # it has burnt its 0.3 s
        used = cpu_used(before, stack_cpu(os.getpid()))
    finally:
        child.kill()
        child.wait()
    assert used["python"] >= 0.3   # this test's process and the child are both "python"


def test_rounds_alternate_which_mode_runs_first():
    assert run_order(3) == [False, True, True, False, False, True]
    assert run_order(1) == [False, True]


def test_samples_through_tracing_code_are_counted_from_py_spy_raw_output():
    raw = "\n".join([
        "_run (asyncio/events.py:80);generate (services/router/servicer.py:181);"
        "start (services/common/tracing.py:143);start_span (opentelemetry/sdk/trace/__init__.py:1100) 3",
        "run (services/worker/loop.py:40);forward (engine/models/llama.py:200) 90",
        "worker (/venv/lib/python3.11/site-packages/opentelemetry/sdk/_shared_internal/__init__.py:160);"
        "export (services/common/tracing.py:228);dumps (json/__init__.py:231) 2",
        "run (threading.py:982);worker (opentelemetry/sdk/_shared_internal/__init__.py:160) 4",
        "finish (services/worker/trace.py:59) 1",
        "",
        "garbage",
    ])
    assert tracing_samples(raw) == (10, 100)
    assert tracing_samples("") == (0, 0)
