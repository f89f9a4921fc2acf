"""A live co-located worker process: step metrics on /metrics after a request, the busy log line
(and silence when idle), a profiler trace of its next N steps, and CPU pinning (`--cpu-cores`)."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.e2e.stack import INTERNAL_METADATA, Service

pytestmark = pytest.mark.timeout(120)

LOG_EVERY_S = 0.2
BUSY_LINE = "#running-req"


@pytest.fixture(scope="module")
def worker(tiny_llama, tmp_path_factory):
    traces = tmp_path_factory.mktemp("traces")
    svc = Service("tandem.cli", "colocated", "--model", str(tiny_llama), "--dtype", "float32",
                  "--page-size", "4", "--max-total-tokens", "2048", "--port", "0", "--metrics-port", "0",
                  "--cpu-cores", "0", "--log-stats-interval", str(LOG_EVERY_S), "--profile-dir", str(traces),
                  "--step-trace-dir", str(traces / "steps"))
    try:
        info = svc.wait_ready(90)
        channel = grpc.insecure_channel(info["grpc_addr"])
        yield svc, info, generation_pb2_grpc.GenerationStub(channel), traces
        channel.close()
    finally:
        svc.close()


def generate(stub, n_out: int, prompt_len: int = 24, first: int = 5) -> list[int]:
    req = generation_pb2.GenerateRequest(sampling=generation_pb2.SamplingParams(
        temperature=0, max_tokens=n_out, ignore_eos=True))
    req.token_ids.ids.extend(range(first, first + prompt_len))
    return [t for chunk in stub.Generate(req, timeout=60, metadata=INTERNAL_METADATA) for t in chunk.token_ids]


def scrape(info) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=5).read().decode()


def value(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def test_the_worker_runs_on_the_cores_it_was_given(worker):
    svc, info, _, _ = worker
    assert info["cpu_cores"] == "0" and info["num_threads"] == 1
    pid = svc.proc.pid
    for task in Path(f"/proc/{pid}/task").iterdir():  # every thread inherited the mask
        status = (task / "status").read_text()
        assert re.search(r"^Cpus_allowed_list:\s+0$", status, re.M), f"thread {task.name} is not on core 0"


def test_step_metrics_after_a_request(worker):
    _, info, stub, _ = worker
    before = scrape(info)
    assert len(generate(stub, 8)) == 8

    def grew(name: str, labels: str) -> float:
        old = re.search(rf"^{re.escape(name + labels)} (\S+)$", before, re.M)
        return value(after, name, labels) - (float(old.group(1)) if old else 0.0)

    # The last token reaches the client while its step is still finishing on the engine thread.
    deadline = time.monotonic() + 5
    after = scrape(info)
    while grew("tandem_step_duration_seconds_count", '{kind="decode"}') < 7 and time.monotonic() < deadline:
        time.sleep(0.05)
        after = scrape(info)

    # One prefill step (the prompt fits one chunk and samples the first token), 7 decode steps.
    assert grew("tandem_step_duration_seconds_count", '{kind="prefill"}') == 1
    assert grew("tandem_step_duration_seconds_count", '{kind="decode"}') == 7
    assert grew("tandem_step_duration_seconds_sum", '{kind="decode"}') > 0
    assert grew("tandem_step_tokens_sum", '{kind="prefill"}') == 24
    assert grew("tandem_step_batch_size_sum", '{kind="decode"}') == 7
    assert grew("tandem_engine_tokens_total", '{phase="decode"}') == 7
    assert grew("tandem_engine_tokens_total", '{phase="prefill"}') == 24
    for gauge in ("tandem_requests_running", "tandem_requests_waiting", "tandem_kv_cache_usage"):
        assert value(after, gauge) >= 0
    assert re.search(r'^vllm:num_requests_running\{model_name=".+"\} ', after, re.M)  # the aliases stay


def test_step_trace_has_a_line_per_step(worker):
    _, info, stub, traces = worker
    path = traces / "steps" / f"{info['worker_id']}.jsonl"
    seen = len(path.read_text().splitlines()) if path.exists() else 0
    assert len(generate(stub, 5, prompt_len=20, first=300)) == 5  # no prefix shared with other tests
    deadline = time.monotonic() + 5
    while len(path.read_text().splitlines()) < seen + 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    steps = [json.loads(line) for line in path.read_text().splitlines()[seen:]]
    assert [(s["kind"], s["prefill_tokens"], s["decode_tokens"]) for s in steps] == [("prefill", 20, 0)] + [("decode", 0, 1)] * 4
    assert all(s["seconds"] > 0 and abs(s["end"] - time.time()) < 60 for s in steps)


def test_busy_log_line_while_busy_and_silence_when_idle(worker):
    svc, _, stub, _ = worker
    generate(stub, 400)  # hundreds of steps: longer than a log interval
    time.sleep(0.2)
    lines = [line for line in list(svc.log) if BUSY_LINE in line]
    assert lines, "no busy line:\n" + "\n".join(svc.log)
    assert re.search(r"#running-req \d+, #queue-req \d+, prefill [\d.]+ tok/s, gen throughput [\d.]+ tok/s, "
                     r"KV usage [\d.]+%", lines[-1]), lines[-1]
    seen = len([line for line in list(svc.log) if BUSY_LINE in line])
    time.sleep(8 * LOG_EVERY_S)  # idle: nothing more
    assert len([line for line in list(svc.log) if BUSY_LINE in line]) == seen


def test_profile_of_the_next_steps(worker):
    _, info, stub, traces = worker
    url = f"http://127.0.0.1:{info['metrics_port']}/profile?steps=3&wait=0"
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10) as resp:
        assert resp.status == 202
        path = Path(json.loads(resp.read())["path"])
    assert path.parent == traces and not path.exists()  # idle: waits for steps
    generate(stub, 6)
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    events = json.loads(path.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("tandem_step#")}
    assert steps == {"tandem_step#0", "tandem_step#1", "tandem_step#2"}
    assert os.path.getsize(path) > 0


def test_tandem_up_places_each_worker_and_forwards_the_flags(tiny_llama, tmp_path):
    from tandem.services.common.cpu_cores import available_cores, format_cpu_list, plan_cores
    from tests.e2e.stack import Stack

    stack = Stack("--model", str(tiny_llama), "--dtype", "float32", "--page-size", "4", "--max-total-tokens", "1024",
                  "--transfer-backend", "tcp", "--profile-dir", str(tmp_path), "--log-stats-interval", "0.5")
    try:
        plan = plan_cores("auto", available_cores(), 2)
        expected = {"prefill-0": format_cpu_list(plan.workers[0]), "decode-0": format_cpu_list(plan.workers[1])}
        assert {k: v for k, v in stack.info["cpu_cores"].items() if k != "services"} == expected
        for w in stack.info["workers"]:
            name = f"{w['role']}-0"
            assert w["cpu_cores"] == expected[name] and w["num_threads"] == len(plan.workers[name == "decode-0"])
            status = Path(f"/proc/{w['pid']}/status").read_text()
            assert re.search(rf"^Cpus_allowed_list:\s+{expected[name]}$", status, re.M), name
        decode = stack.workers("decode")[0]
        url = f"http://127.0.0.1:{decode['metrics_port']}/profile?steps=1&wait=0"
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10) as resp:
            assert Path(json.loads(resp.read())["path"]).parent == tmp_path
    finally:
        stack.close()


def test_an_unwritable_step_trace_dir_stops_the_worker_before_it_loads(tiny_llama, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    svc = Service("tandem.cli", "colocated", "--model", str(tiny_llama), "--dtype", "float32", "--port", "0",
                  "--metrics-port", "-1", "--step-trace-dir", str(blocker / "steps"))
    try:
        assert svc.proc.wait(60) != 0
        time.sleep(0.2)  # the log pump drains the pipe
        assert any("--step-trace-dir" in line and "cannot write step traces" in line for line in svc.log), \
            "\n".join(svc.log)
    finally:
        svc.close()
