"""`/profile` on a worker's metrics port: a torch.profiler trace of exactly the next N engine steps."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from tandem.services.worker.loop import EngineLoop
from tandem.services.worker.metrics_server import start_metrics_server
from tandem.services.worker.profiler import StepProfiler

pytestmark = pytest.mark.timeout(60)


class MatmulWorker:
    """A StepWorker whose steps are small matmuls; it has work while `budget` > 0."""

    def __init__(self):
        self.budget = 0
        self.steps = 0
        self.x = torch.randn(32, 32)

    def has_work(self) -> bool:
        return self.budget > 0

    def step(self) -> None:
        self.budget -= 1
        self.steps += 1
        torch.mm(self.x, self.x)

    def tick(self) -> None: ...

    def on_idle(self) -> None: ...

    def polling(self) -> bool:
        return False


def _post(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=40) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _step_ranges(path: Path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return sorted({e["name"] for e in events if e.get("name", "").startswith("tandem_step#")})


@pytest.fixture
def served(tmp_path):
    worker = MatmulWorker()
    profiler = StepProfiler(tmp_path / "traces", "colocated-test")
    aio = asyncio.new_event_loop()
    loop = EngineLoop(worker, aio, observers=[profiler], quiet_wait_s=0.01)
    loop.start()
    server = start_metrics_server("127.0.0.1", 0, profiler)
    yield worker, loop, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    loop.stop()
    aio.close()


def test_profile_records_exactly_the_next_n_steps(served):
    worker, loop, base = served
    status, body = _post(f"{base}/profile?steps=3&wait=0")
    assert status == 202 and body["status"] == "recording", body  # idle: no steps yet
    path = Path(body["path"])
    assert path.name.endswith("-3steps.trace.json") and "colocated-test" in path.name
    assert _post(f"{base}/profile?steps=1&wait=0")[0] == 409  # one trace at a time
    worker.budget = 5
    loop.post(lambda: None)  # wake the loop
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    while worker.budget and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _step_ranges(path) == ["tandem_step#0", "tandem_step#1", "tandem_step#2"]
    assert worker.steps == 5
    assert "aten::mm" in path.read_text()

    # Asked while busy, the answer waits for the file (GET works too).
    worker.budget = 10_000
    loop.post(lambda: None)
    with urllib.request.urlopen(f"{base}/profile?steps=2", timeout=40) as resp:
        assert resp.status == 200
        body = json.loads(resp.read())
    worker.budget = 0
    assert body["status"] == "written" and _step_ranges(Path(body["path"])) == ["tandem_step#0", "tandem_step#1"]


def test_bad_profile_queries_and_metrics_still_served(served):
    _, _, base = served
    for query in ("steps=0", "steps=x", "steps=2&wait=-1"):
        status, body = _post(f"{base}/profile?{query}")
        assert status == 400 and "expected steps=N" in body["error"], (query, body)
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        assert resp.status == 200 and b"# TYPE python_gc_objects_collected_total" in resp.read()
    assert _post(f"{base}/metrics")[0] == 404
