"""One request through a real 1P1D stack with tracing on: the gateway's, the router's and both
workers' spans share the trace id of the client's `traceparent` and nest (every parent is a span of
the trace, the root's is the client's). Read back from the file exporter, and from a real OTLP/gRPC
receiver (the collector's TraceService, served in the test)."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent import futures

import grpc
import pytest

from tandem.bench.trace_breakdown import breakdown
from tandem.cli.main import main
from tandem.cli.trace_cmd import find, load, timeline
from tests.e2e.stack import Stack, service_env

pytestmark = pytest.mark.timeout(300)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVICES = {"tandem-gateway", "tandem-router", "tandem-prefill", "tandem-decode"}
NAMES = {"POST /v1/completions", "router.generate", "router.queue", "router.attempt", "tandem.prefill",
         "prefill.queue", "prefill.chunk", "prefill.kv_transfer", "tandem.decode", "decode.bootstrap", "decode.admission", "decode.wait_kv",
         "decode.first_token"}


def engine_args(model) -> list[str]:
    return ["--model", str(model), "--dtype", "float32", "--page-size", "4", "--max-total-tokens", "2048"]


def complete(stack: Stack) -> None:
    body = json.dumps({"model": stack.info.get("model") or "", "prompt": "hello there", "max_tokens": 4}).encode()
    req = urllib.request.Request(stack.gateway_url + "/v1/completions", body, method="POST", headers={
        "content-type": "application/json", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200


def model_id(stack: Stack) -> str:
    with urllib.request.urlopen(stack.gateway_url + "/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def check(spans: list[dict]) -> None:
    assert {s["trace_id"] for s in spans} == {TRACE_ID}
    assert {s["service"] for s in spans} == SERVICES
    assert NAMES <= {s["name"] for s in spans}
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent_id"] not in ids]
    assert [(r["name"], r["parent_id"]) for r in roots] == [("POST /v1/completions", CLIENT_SPAN)]
    by_name = {s["name"]: s for s in spans}
    parent = {s["span_id"]: s["name"] for s in spans}
    assert parent[by_name["router.generate"]["parent_id"]] == "POST /v1/completions"
    assert parent[by_name["tandem.prefill"]["parent_id"]] == "router.attempt"
    route = by_name["router.attempt"]["attributes"]
    assert route["tandem.route"] == "remote" and route["tandem.route.policy"]
    assert sorted(c.split(":")[0] for c in route["tandem.route.candidates"]) == ["decode", "prefill"]
    assert all(" cost=" in c for c in route["tandem.route.candidates"])
    assert parent[by_name["tandem.decode"]["parent_id"]] == "router.attempt"
    assert parent[by_name["decode.bootstrap"]["parent_id"]] == "tandem.decode"
    assert by_name["tandem.decode"]["attributes"]["gen_ai.usage.output_tokens"] == 4
    assert by_name["prefill.kv_transfer"]["attributes"]["tandem.kv.bytes"] > 0
    assert by_name["prefill.kv_transfer"]["attributes"]["tandem.kv.backend"] in ("shm", "tcp")   # what auto chose
    assert parent[by_name["prefill.chunk"]["parent_id"]] == "tandem.prefill"
    assert by_name["prefill.chunk"]["attributes"]["tandem.chunk.tokens"] > 0
    for s in spans:   # children inside their parents (same clock: one machine)
        if s["parent_id"] in ids:
            p = next(x for x in spans if x["span_id"] == s["parent_id"])
            assert p["start_ns"] - 2e6 <= s["start_ns"] and s["end_ns"] <= p["end_ns"] + 2e6, (s["name"], p["name"])


def wait_for(read, timeout_s: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    spans: list[dict] = []
    while time.monotonic() < deadline:
        spans = read()
        if {s["service"] for s in spans} >= SERVICES and NAMES <= {s["name"] for s in spans}:
            time.sleep(1.0)   # the gateway's span ends last: let its batch land too
            return read()
        time.sleep(0.3)
    return spans


def test_file_exporter_one_trace_across_processes(tiny_llama, tmp_path):
    path = tmp_path / "traces.jsonl"
    stack = Stack(*engine_args(tiny_llama), "--otlp-traces-endpoint", f"file://{path}", gateway=True)
    try:
        stack.info["model"] = model_id(stack)
        complete(stack)
        spans = wait_for(lambda: load(str(path)).get(TRACE_ID, []) if path.exists() else [])
        # `tandem bench serve --trace-file` breaks its own requests' TTFT into phases.
        out = tmp_path / "bench.json"
        assert main(["bench", "serve", "--backend", "tandem-grpc", "--base-url", stack.info["router"],
                     "--model", str(tiny_llama), "--num-prompts", "3", "--input-len", "16", "--output-len", "4",
                     "--num-warmups", "0", "--trace-file", str(path), "--out", str(out), "--no-progress",
                     "--no-plot"]) == 0
    finally:
        stack.close()
    check(spans)
    bench = json.loads(out.read_text())["ttft_breakdown"]
    assert bench["requests"] == 3 and bench["phases"]["prefill_compute"]["n"] == 3
    lines = timeline(find(load(str(path)), None))
    assert "router.queue" in "\n".join(lines)
    phases = breakdown(load(str(path)))["phases"]
    assert {"router_queue", "prefill_compute", "decode_wait_kv", "decode_first_token", "ttft"} <= set(phases)


def _value(v):
    """An OTLP AnyValue as Python (arrays as lists)."""
    kind = v.WhichOneof("value")
    return [_value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)


class _Receiver:
    """The OTLP TraceService a collector serves, keeping what it receives as the file exporter's dicts."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.spans: list[dict] = []
        outer = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                for rs in request.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            outer.spans.append({
                                "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                "parent_id": s.parent_span_id.hex() or None, "name": s.name, "service": service,
                                "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                                "attributes": {a.key: _value(a.value) for a in s.attributes}})
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


# A stack of its own for the co-located role's two spans: `make test-slow` (CI runs it). The 1P1D trace
# above, through every service, stays in `make test`.
@pytest.mark.slow
def test_colocated_worker_joins_the_trace(tiny_llama, tmp_path):
    path = tmp_path / "traces.jsonl"
    stack = Stack(*engine_args(tiny_llama), "--mode", "colocated", "--otlp-traces-endpoint", f"file://{path}",
                  gateway=True)
    names = {"POST /v1/completions", "router.generate", "router.attempt", "tandem.colocated",
             "colocated.first_token"}
    try:
        stack.info["model"] = model_id(stack)
        complete(stack)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (
                path.exists() and names <= {s["name"] for s in load(str(path)).get(TRACE_ID, [])}):
            time.sleep(0.3)
        time.sleep(1.0)
    finally:
        stack.close()
    spans = load(str(path))[TRACE_ID]
    parent = {s["span_id"]: s["name"] for s in spans}
    by_name = {s["name"]: s for s in spans}
    assert names <= set(by_name)
    assert parent[by_name["tandem.colocated"]["parent_id"]] == "router.attempt"
    assert by_name["tandem.colocated"]["attributes"]["gen_ai.usage.output_tokens"] == 4


@pytest.mark.slow
def test_otlp_receiver_gets_one_trace(tiny_llama):
    receiver = _Receiver()
    # The standard variables, no flag: every process of the stack inherits them.
    env = dict(service_env(), OTEL_TRACES_EXPORTER="otlp",
               OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.port}")
    stack = Stack(*engine_args(tiny_llama), gateway=True, env=env)
    try:
        stack.info["model"] = model_id(stack)
        complete(stack)
        spans = wait_for(lambda: [s for s in list(receiver.spans) if s["trace_id"] == TRACE_ID])
    finally:
        stack.close()
        receiver.server.stop(0)
    check(spans)
