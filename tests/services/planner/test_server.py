"""The planner's process loop: decisions logged as JSON lines, exported as metrics, applied; SIGTERM."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from tandem.services.planner.config import PlannerConfig
from tandem.services.planner.observe import RouterObserver
from tandem.services.planner.server import PlannerService, make_actuator
from tandem.services.planner.shape import Shape
from tandem.services.router.metrics import RouterMetrics
from tandem.v1 import worker_pb2
from tests.services.planner.helpers import FakeActuator

ROOT = Path(__file__).resolve().parents[3]


def _router(metrics: RouterMetrics, shape: Shape) -> None:
    """The router's registry: `shape`'s workers with fitted step costs."""
    workers = [worker_pb2.WorkerInfo(worker_id=f"p{i}", role=worker_pb2.WORKER_ROLE_PREFILL, load=worker_pb2.WorkerLoad(
        step_cost=worker_pb2.StepCost(base_s=0.03, per_prefill_token_s=0.0015, steps=9))) for i in range(shape.prefill)]
    workers += [worker_pb2.WorkerInfo(worker_id=f"d{i}", role=worker_pb2.WORKER_ROLE_DECODE, load=worker_pb2.WorkerLoad(
        step_cost=worker_pb2.StepCost(base_s=0.03, per_decode_row_s=0.002, steps=9))) for i in range(shape.decode)]
    metrics.watch_workers(lambda: workers)


def _interval(metrics: RouterMetrics, rate: float, seconds: float) -> None:
    for _ in range(int(rate * seconds)):
        metrics.arrivals.inc()
        metrics.prompt_tokens.observe(256)
        metrics.output_tokens.observe(64)


def test_each_interval_is_logged_exported_and_a_reshape_applied():
    router, clock = RouterMetrics(), [0.0]
    _router(router, Shape(1, 1))
    cfg = PlannerConfig(target="host", redis_url="redis://unused", router_metrics_url="http://router/metrics",
                        stable_intervals=2, cooldown_s=0.0, metrics_port=-1)
    act = FakeActuator(Shape(1, 1))
    out = io.StringIO()
    observer = RouterObserver(cfg.router_metrics_url, fetch=lambda: generate_latest(router.registry).decode(),
                              clock=lambda: clock[0])
    service = PlannerService(cfg, act, observer, out=out)
    assert service.step() is None        # the first scrape
    decisions = []
    for _ in range(3):
        clock[0] += 10
        _interval(router, 2.0, 10)       # 2 req/s: two co-located workers keep up, 1P1D does not
        decisions.append(service.step())
    assert [d.action for d in decisions] == ["hold", "reshape", "keep"]
    assert act.applied == [Shape(0, 2)]
    lines = [json.loads(line)["planner"] for line in out.getvalue().splitlines()]
    assert [x["action"] for x in lines] == ["hold", "reshape", "keep"]
    assert lines[1]["desired"] == "0P2D" and lines[1]["inputs"]["predicted"]["rate"] > 0
    assert lines[1]["scores"]["1P1D"]["feasible"] is False
    reg = service.metrics.registry
    assert reg.get_sample_value("tandem_planner_desired_workers", {"role": "decode"}) == 2
    assert reg.get_sample_value("tandem_planner_current_workers", {"role": "prefill"}) == 0
    assert reg.get_sample_value("tandem_planner_decisions_total", {"action": "reshape"}) == 1
    assert reg.get_sample_value("tandem_planner_predicted_arrival_rate") == pytest.approx(2.0, rel=0.2)
    assert 0 < reg.get_sample_value("tandem_planner_predicted_ttft_seconds") < cfg.ttft_slo_s
    service.close()
    service.close()   # twice is fine


def test_decisions_also_go_to_the_decision_log_file(tmp_path):
    router, clock = RouterMetrics(), [0.0]
    _router(router, Shape(1, 1))
    log = tmp_path / "decisions.jsonl"
    cfg = PlannerConfig(router_metrics_url="http://router/metrics", metrics_port=-1, decision_log=str(log))
    observer = RouterObserver(cfg.router_metrics_url, fetch=lambda: generate_latest(router.registry).decode(),
                              clock=lambda: clock[0])
    out = io.StringIO()
    service = PlannerService(cfg, None, observer, out=out)
    service.step()
    for _ in range(2):
        clock[0] += 10
        _interval(router, 1.0, 10)
        service.step()
    assert log.read_text().splitlines() == out.getvalue().splitlines()
    assert len(log.read_text().splitlines()) == 2


def test_the_metrics_target_has_no_actuator():
    assert make_actuator(PlannerConfig(router_metrics_url="http://r/metrics")) is None


def test_sigterm_stops_the_process_cleanly():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "tandem.services.planner", "--router-metrics-url", "http://127.0.0.1:9/metrics",
         "--planner-interval", "0.2", "--metrics-port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("TANDEM_READY "), line + proc.stderr.read()
        port = json.loads(line.split(" ", 1)[1])["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "tandem_planner_decisions_total" in text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "cannot read the router's metrics" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
