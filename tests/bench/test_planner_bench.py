"""bench/planner.py: deployments, shape sampling, the verdict, and a whole run against fake deployments
(a fake gRPC server and a fake router metrics endpoint; no model, no torch). The same run against
`tandem up` with a tiny model is the slow smoke test at the end."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tandem.bench import planner as pb
from tandem.bench.planner_report import format_summary, verdict
from tandem.bench.serve.deployment import Endpoint
from tandem.bench.serve.load_profile import parse_load_profile
from tandem.bench.serve.metrics import SLO
from tests.bench.fakes import FakeServer, byte_level_bpe

METRICS = """# HELP tandem_router_workers Registered workers by role
# TYPE tandem_router_workers gauge
tandem_router_workers{role="prefill"} %d.0
tandem_router_workers{role="decode"} %d.0
tandem_router_workers{role="colocated"} %d.0
"""


def test_workers_and_shape_labels_from_router_metrics():
    counts = pb.parse_workers(METRICS % (0, 2, 0) + 'tandem_router_inflight 3.0\n')
    assert counts == {"prefill": 0, "decode": 2, "colocated": 0} and pb.shape_label(counts) == "0P2D"
    assert pb.shape_label(pb.parse_workers(METRICS % (1, 1, 0))) == "1P1D"
    assert pb.shape_label(pb.parse_workers(METRICS % (0, 0, 2))) == "2C"
    assert pb.shape_label(pb.parse_workers("")) == "none"


def test_deployments_by_name_planner_args_from_the_slo_and_custom_ones():
    cfg = pb.PlannerBenchConfig(slo=SLO(ttft=1.5, tpot=0.1), deployments=pb.split_deployments(
        "1p1d;colocated-dp2;planner;mine=--prefill 1 --decode 1 --planner --cpu-cores 0,1"))
    deps = pb.make_deployments(cfg)
    assert [d.name for d in deps] == ["1p1d", "colocated-dp2", "planner", "mine"]
    assert [pb.is_planner(d) for d in deps] == [False, False, True, True]
    assert deps[2].mode_args[-6:-2] == ["--ttft-slo", "1.5", "--itl-slo", "0.1"]
    assert deps[2].mode_args[-2:] == ["--planner-decision-log", str(pb.decision_log_path(cfg, "planner"))]
    assert deps[3].mode_args[-1].endswith("planner.mine.decisions.jsonl")
    assert deps[1].mode_args == ["--mode", "colocated", "--colocated", "2"]
    assert "--cpu-cores 0,1" in deps[3].describe()
    with pytest.raises(ValueError, match="must differ"):
        pb.make_deployments(pb.PlannerBenchConfig(deployments=("1p1d", "1p1d=--prefill 1 --decode 1")))


def test_decisions_read_back_from_the_planners_log_relative_to_the_run(tmp_path):
    log = tmp_path / "d.jsonl"
    rows = [{"t": 110.0, "current": "1P1D", "desired": "1P1D", "action": "keep", "reason": "fine", "scores": {"x": 1}},
            {"t": 130.5, "current": "1P1D", "desired": "0P2D", "action": "reshape", "reason": "why", "scores": {"y": 2}}]
    log.write_text("\n".join(json.dumps({"planner": r}) for r in rows) + "\nnot json\n")
    got = pb.read_decisions(log, wall0=100.0)
    assert got == [{"t_s": 10.0, "current": "1P1D", "desired": "1P1D", "action": "keep", "reason": "fine"},
                   {"t_s": 30.5, "current": "1P1D", "desired": "0P2D", "action": "reshape", "reason": "why",
                    "scores": {"y": 2}}]
    assert pb.read_decisions(tmp_path / "missing.jsonl", 0.0) == []


def _entry(goodput, phases, failed=0, planner=False):
    return {"planner": planner, "metrics": {"goodput": goodput, "failed": failed, "failures": {"shed": failed} if failed else {}},
            "phases": [{"name": f"p{i}", "spec": "1s@1:1/1", "metrics": {"goodput": g}} for i, g in enumerate(phases)]}


def test_verdict_against_the_best_fixed_shape_overall_and_per_phase():
    fixed = {"1p1d": _entry(1.0, [0.5, 1.2, 0.9]), "colocated-dp2": _entry(0.9, [0.4, 1.6, 0.5])}
    good = {**fixed, "planner": _entry(1.3, [0.5, 1.5, 0.85], planner=True)}
    v = verdict({"deployments": good})
    assert v["passed"] is True and len(v["checks"]) == 5
    assert "1.30x the best fixed shape (1p1d" in v["checks"][0]["detail"]
    assert "colocated-dp2" in v["checks"][2]["detail"]             # the best shape of the burst phase
    bad = {**fixed, "planner": _entry(1.2, [0.5, 1.4, 0.9], failed=2, planner=True)}
    v = verdict({"deployments": bad})
    assert v["passed"] is False
    assert [c["passed"] for c in v["checks"]] == [False, True, False, True, False]
    assert verdict({"deployments": fixed})["passed"] is None
    text = format_summary({"deployments": bad, "verdict": v, "profile_phases": ["p0", "p1", "p2"],
                           "skipped": {"x": "no --planner flag\nmore"}})
    assert "verdict: FAIL" in text and "x               skipped: no --planner flag" in text


class _Metrics:
    """A router metrics endpoint whose worker counts follow `shape_at(seconds since start)`."""

    def __init__(self, shape_at):
        t0 = time.monotonic()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = (METRICS % shape_at(time.monotonic() - t0)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class FakeDeployment:
    def __init__(self, name, gap, shape_at, planner=False):
        self.name, self.gap, self.shape_at = name, gap, shape_at
        self.mode_args = ["--planner"] if planner else []
        self.router_metrics_url = None
        self._server = self._metrics = None

    def start(self):
        self._server = FakeServer(self.gap).__enter__()
        self._metrics = _Metrics(self.shape_at)
        self.router_metrics_url = self._metrics.url
        return Endpoint("tandem-grpc", f"127.0.0.1:{self._server.port}")

    def close(self):
        if self._server is not None:
            self._server.__exit__(None, None, None)
            self._metrics.close()
            self._server = None

    def describe(self):
        return f"fake {self.name}"

    def log_tail(self):
        return ""


def test_one_trace_against_every_deployment_with_shapes_sampled(tmp_path):
    out = tmp_path / "planner.json"
    cfg = pb.PlannerBenchConfig(profile=parse_load_profile("a=1s@8:6/2,b=1s@4:12/3"), slo=SLO(ttft=5.0),
                                num_warmups=1, sample_s=0.2, window_s=0.5, out=str(out), progress=False)
    deps = [FakeDeployment("1p1d", 0.002, lambda t: (1, 1, 0)),
            FakeDeployment("planner", 0.001, lambda t: (1, 1, 0) if t < 1.5 else (0, 2, 0), planner=True)]
    res = pb.run_planner_bench(cfg, deps, echo=lambda s: None, tokenizer=byte_level_bpe())
    saved = json.loads(out.read_text())
    assert saved["verdict"] == res["verdict"] and set(saved["deployments"]) == {"1p1d", "planner"}
    a, b = saved["deployments"]["1p1d"], saved["deployments"]["planner"]
    assert [r["sent_ms"] for r in a["requests"]] == pytest.approx([r["sent_ms"] for r in b["requests"]], abs=200)
    assert [r["prompt_len"] for r in a["requests"]] == [r["prompt_len"] for r in b["requests"]]   # the same trace
    assert a["metrics"]["failed"] == 0 and [p["name"] for p in a["phases"]] == ["a", "b"]
    assert a["shapes_seen"] == ["1P1D"] and b["shapes_seen"] == ["0P2D", "1P1D"]
    assert len(b["shape"]) >= 4 and all("t_s" in s for s in b["shape"])
    assert saved["planners"] == ["planner"] and saved["verdict"]["passed"] in (True, False)
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_smoke_against_tandem_up_with_a_tiny_model(tiny_llama, tmp_path):
    """The two fixed shapes and the planner (`tandem up --planner`), a few requests: the shapes come from
    the router's metrics, and the planner is judged against the fixed shapes."""
    out = tmp_path / "planner.json"
    cfg = pb.PlannerBenchConfig(model=str(tiny_llama), profile=parse_load_profile("3s@1:16/4,2s@1:32/2"),
                                slo=SLO(ttft=30.0, tpot=1.0), num_warmups=1,
                                sample_s=0.5, tandem_backend="tandem-grpc", dtype="float32",
                                up_args=("--kv-cache-gb", "0.05"), start_timeout_s=240, out=str(out), progress=False)
    res = pb.run_planner_bench(cfg, echo=lambda s: None)
    assert not res["skipped"], res["skipped"]
    shapes = {n: e["shapes_seen"] for n, e in res["deployments"].items()}
    assert shapes["1p1d"] == ["1P1D"] and shapes["colocated-dp2"] == ["2C"] and shapes["planner"]
    assert all(e["metrics"]["completed"] > 0 and e["metrics"]["failed"] == 0 for e in res["deployments"].values())
    assert res["planners"] == ["planner"] and res["verdict"]["passed"] in (True, False)
    assert len(res["verdict"]["checks"]) == 1 + 2 + 1        # overall, each phase, failures
