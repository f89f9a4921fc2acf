"""services/common/tracing.py with the SDK's in-memory exporter: settings, context across a
process boundary (gRPC metadata), spans with explicit times, and nothing at all while off."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.cli.trace_cmd import find, timeline
from tandem.services.common import tracing


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracing.install(exporter, "test")
    yield exporter
    tracing.shutdown()


def test_settings_from_flag_and_env():
    assert not tracing.settings_from_env("", "x", {}).enabled
    assert tracing.settings_from_env("file:///t", "x", {}).endpoint == "file:///t"
    assert tracing.settings_from_env("", "x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}).endpoint == \
        "http://c:4317"
    assert tracing.settings_from_env("", "x", {"OTEL_TRACES_EXPORTER": "otlp"}).endpoint == "http://localhost:4317"
    off = {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}
    assert not tracing.settings_from_env("http://c:4317", "x", off).enabled
    assert tracing.settings_from_env("", "x", {"OTEL_SERVICE_NAME": "gw"}).service_name == "gw"


def test_off_is_a_no_op():
    assert not tracing.enabled()
    assert tracing.start("x") is None and tracing.outgoing() is None
    assert tracing.extract([("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")]) is None
    tracing.record("x", None, 0.0, 1.0)
    tracing.end(None)


def test_one_trace_across_processes_nests(spans):
    incoming = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    gateway = tracing.start("POST /v1/completions", tracing.extract({"traceparent": incoming}), server=True)
    with tracing.current(gateway):
        metadata = tracing.outgoing()          # what the router call carries
    router = tracing.start("router.generate", tracing.extract(metadata), server=True)
    t0 = time.monotonic()
    tracing.record("router.queue", router, t0 - 0.010, t0)
    with tracing.current(router):
        worker = tracing.start("tandem.decode", tracing.extract(tracing.outgoing()), server=True)
    tracing.record("decode.wait_kv", worker, t0 - 0.005, t0 - 0.001)
    for s in (worker, router, gateway):
        tracing.end(s)
    tracing.flush()
    done = {s.name: s for s in spans.get_finished_spans()}
    assert {s.context.trace_id for s in done.values()} == {int("ab" * 16, 16)}
    assert done["POST /v1/completions"].parent.span_id == int("cd" * 8, 16)
    assert done["router.generate"].parent.span_id == gateway.get_span_context().span_id
    assert done["router.queue"].parent.span_id == router.get_span_context().span_id
    assert done["tandem.decode"].parent.span_id == router.get_span_context().span_id
    wait = done["decode.wait_kv"]
    assert wait.parent.span_id == worker.get_span_context().span_id
    assert 3.5e6 < wait.end_time - wait.start_time < 4.5e6   # the engine's stamps, not the export time


def test_file_exporter_lines_and_timeline(tmp_path):
    path = tmp_path / "t.jsonl"
    tracing.install(tracing.JsonLinesExporter(str(path)), "svc")
    try:
        root = tracing.start("root", attributes={"tandem.request_id": "cmpl-1"})
        tracing.record("child", root, time.monotonic() - 0.002, time.monotonic())
        tracing.end(root)
    finally:
        tracing.shutdown()
    from tandem.cli.trace_cmd import load

    traces = load(str(path))
    lines = timeline(find(traces, "cmpl-1"))
    assert lines[2].split()[2] == "root" and lines[3].split()[2] == "child"
    assert lines[3].index("child") > lines[2].index("root")     # nested under its parent
    assert find(traces, "nope") is None


def test_off_never_imports_the_sdk():
    # A fresh interpreter: the services' request paths imported and tracing configured off.
    import subprocess
    import sys

    code = ("import sys\n"
            "import tandem.services.gateway.app, tandem.services.router.servicer, tandem.services.decode.servicer, tandem.services.prefill.servicer\n"
            "from tandem.services.common import tracing\n"
            "assert not tracing.configure('', 'x', {})\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
