"""`tandem bench serve|sweep` end to end against a fake gRPC server (no model, no torch)."""

import argparse
import json
import math

import pytest

from tandem.bench.flags import floats
from tandem.bench.serve import sweep, sweep_report
from tandem.bench.serve.sweep import DeploymentUnavailable, Endpoint, SweepConfig, make_deployment
from tandem.cli import bench_cmd
from tests.bench.fakes import FakeServer


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    return bench_cmd.run(parser.parse_args(list(argv)))


def test_serve_command_writes_json_and_plots(tokenizer_dir, tmp_path):
    out = tmp_path / "res.json"
    with FakeServer(gap=0.002) as fake:
        rc = cli("serve", "--backend", "tandem-grpc", "--base-url", f"127.0.0.1:{fake.port}",
                 "--model", str(tokenizer_dir), "--num-prompts", "6", "--input-len", "20", "--output-len", "4",
                 "--request-rate", "inf,200", "--max-concurrency", "4", "--num-warmups", "2",
                 "--slo", "ttft=5s,tpot=1s", "--out", str(out), "--no-progress")
        sent = list(fake.servicer.requests)
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["config"]["request_rates"] == ["inf", "200"] and res["machine"]["cores"] >= 1
    assert [r["request_rate"] for r in res["runs"]] == ["inf", "200"]
    for run in res["runs"]:
        m = run["metrics"]
        assert m["completed"] == 6 and m["failed"] == 0 and m["good_requests"] == 6
        assert m["total_output_tokens"] == 24 and m["ttft"]["n"] == 6 and m["itl"]["n"] == 18
        assert len(run["requests"]) == 6 and all(r["output_tokens"] == 4 for r in run["requests"])
    assert len(sent) == 2 + 6 + 6                      # warm-ups once, not measured
    prompts = [tuple(r.token_ids.ids) for r in sent]
    assert len(set(prompts)) == len(prompts)          # no prompt repeats across warm-ups and rates
    assert all(len(p) == 20 for p in prompts)
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".cdf.png").stat().st_size > 0 and out.with_suffix(".rates.png").stat().st_size > 0


def test_serve_command_sends_a_priority_mix_and_reports_each_class(tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "prio.json"
    with FakeServer(gap=0.001) as fake:
        rc = cli("serve", "--backend", "tandem-grpc", "--base-url", f"127.0.0.1:{fake.port}",
                 "--model", str(tokenizer_dir), "--num-prompts", "8", "--input-len", "6", "--output-len", "2",
                 "--num-warmups", "0", "--priority-mix", "9:1,0:3", "--out", str(out), "--no-progress", "--no-plot")
        sent = sorted(r.priority for r in fake.servicer.requests)
    assert rc == 0 and sent == [0] * 6 + [9] * 2
    run = json.loads(out.read_text())["runs"][0]
    assert list(run["by_priority"]) == ["9", "0"]
    assert run["by_priority"]["9"]["completed"] == 2 and run["by_priority"]["0"]["completed"] == 6
    assert sorted(r["priority"] for r in run["requests"]) == sent
    assert "priority    9:    2 ok" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli("serve", "--priority-mix", "9:0", "--model", str(tokenizer_dir))
    assert exit_.value.code == 2 and "weight > 0" in capsys.readouterr().err


def test_serve_command_reports_failures(tokenizer_dir, tmp_path, capsys):
    rc = cli("serve", "--backend", "tandem-grpc", "--base-url", "127.0.0.1:9", "--model", str(tokenizer_dir),
             "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--num-warmups", "0", "--no-progress",
             "--timeout", "5")
    assert rc == 1                                    # nothing completed
    assert "UNAVAILABLE" in capsys.readouterr().out
    assert cli("serve", "--slo", "ttft=fast", "--model", str(tokenizer_dir)) == 2


class FakeDeployment:
    def __init__(self, name, fail=False):
        self.name, self.fail, self.server = name, fail, None

    def describe(self):
        return f"fake {self.name}"

    def log_tail(self):
        return ""

    def start(self):
        if self.fail:
            raise DeploymentUnavailable("not installed here")
        self.server = FakeServer(gap=0.002).__enter__()
        return Endpoint("tandem-grpc", f"127.0.0.1:{self.server.port}")

    def close(self):
        if self.server is not None:
            self.server.__exit__()
            self.server = None


def test_sweep_runs_every_deployment_and_skips_unavailable(tokenizer_dir, tmp_path, monkeypatch, capsys):
    made = []

    def deployment(name, cfg, echo=print):
        made.append((name, cfg.dtype))
        return FakeDeployment(name, fail=name == "transformers")
    monkeypatch.setattr(sweep, "make_deployment", deployment)
    monkeypatch.setattr(sweep, "auto_dtype", lambda model: "float32")   # what Tandem would pick here
    out = tmp_path / "sweep.json"
    rc = cli("sweep", "--model", str(tokenizer_dir), "--request-rates", "100,inf", "--num-prompts", "4",
             "--input-len", "8", "--output-len", "3", "--num-warmups", "1", "--out", str(out), "--no-progress",
             "--no-save-requests", "--slo", "ttft=2s,tpot=150ms")
    assert rc == 0
    assert {dtype for _, dtype in made[-3:]} == {"float32"}        # auto, resolved once, for every deployment
    res = json.loads(out.read_text())
    assert res["config"]["dtype"] == "auto" and res["dtype"] == "float32"
    printed = capsys.readouterr().out
    summary = printed[printed.rindex("goodput = "):printed.index("targets:")].splitlines()
    assert summary[0] == "goodput = requests/s that completed with TTFT <= 2000 ms and TPOT <= 150 ms " \
                         "(the % is of the requests sent)"
    assert summary[1].split() == ["deployment", "rate", "req/s", "achieved", "req/s", "goodput", "req/s", "TTFT",
                                  "p50", "ms", "TTFT", "p99", "ms", "TPOT", "p50", "ms", "ITL", "p99/p50", "failed"]
    assert len({len(line) for line in summary[1:]}) == 1 and len(summary) == 2 + 4     # aligned, one row per run
    assert "[ttft" not in printed and "MISSED" not in printed
    assert "  1p1d at rate inf: target ITL p99/p50 <= 1.5: " in printed
    assert list(res["deployments"]) == ["colocated", "1p1d"]
    assert res["skipped"] == {"transformers": "not installed here"}
    assert all(len(d["runs"]) == 2 and "requests" not in d["runs"][0] for d in res["deployments"].values())
    table = out.with_suffix(".md").read_text()
    assert table.count("| colocated |") == 2 and table.count("| 1p1d |") == 2
    assert any("ITL p99/p50" in line for line in res["targets"])


def metrics(goodput, itl50=40.0, itl99=50.0):
    stats = {"n": 1, "mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0, "percentiles": {"p50": 10.0, "p99": 20.0}}
    return {"completed": 10, "failed": 0, "good_requests": int(goodput * 10), "request_throughput": 1.0,
            "output_throughput": 64.0, "goodput": goodput, "ttft": stats, "tpot": stats,
            "itl": {**stats, "percentiles": {"p50": itl50, "p99": itl99}}, "e2e": stats,
            "itl_p99_over_p50": itl99 / itl50}


def test_target_checks_and_table():
    res = {"deployments": {
        "colocated": {"runs": [{"request_rate": "1", "metrics": metrics(1.0)},
                               {"request_rate": "2", "metrics": metrics(1.5)}]},
        "1p1d": {"runs": [{"request_rate": "1", "metrics": metrics(1.0)},
                          {"request_rate": "2", "metrics": metrics(1.4, itl99=80.0)}]},
        "transformers": {"runs": [{"request_rate": "1", "metrics": metrics(0.2)},
                                  {"request_rate": "2", "metrics": metrics(0.0)}]},
    }}
    res["deployments"]["colocated"]["runs"][0]["metrics"]["goodput"] = 1.01  # within 2%: a tie
    checks = sweep.target_checks(res, SweepConfig())
    assert checks[0] == ("rate 1: 1p1d goodput 1.00 req/s; target >= colocated (1.01): met; "
                         "target >= 3x transformers (0.20): met (5.0x)")
    assert checks[1] == ("rate 2: 1p1d goodput 1.40 req/s; target >= colocated (1.50): missed; "
                         "target >= 3x transformers (0.00): met")
    assert checks[2] == "1p1d at rate 2: target ITL p99/p50 <= 1.5: missed (2.00)"
    table = sweep.comparison_table(res)
    assert len(table.splitlines()) == 2 + 6
    assert "| 1p1d | 2 | 1.00 | 64.0 | 1.40 (140%) | 10 / 20 | 10 / 20 | 40 / 80 | 2.00 | 0 |" in table


def test_vllm_targets_say_when_they_exceed_the_offered_load():
    res = {"deployments": {
        "colocated-dp2": {"runs": [{"request_rate": "2", "metrics": metrics(1.9)}]},
        "1p1d": {"runs": [{"request_rate": "2", "metrics": metrics(1.9)}]},
        "vllm": {"runs": [{"request_rate": "2", "metrics": metrics(1.9)}]},
    }}
    for m in (d["runs"][0]["metrics"] for d in res["deployments"].values()):
        m["request_throughput"] = 1.9
    line = sweep_report.vllm_checks({n: {r["request_rate"]: r["metrics"] for r in d["runs"]}
                              for n, d in res["deployments"].items()})[0]
    assert ("colocated-dp2 1.90, target >= 1.2x vllm: missed (unreachable: vllm serves the offered load within "
            "the SLO)") in line
    assert "1p1d 1.90, target >= 1x vllm: met" in line


def test_deployment_registry():
    cfg = SweepConfig(model="m", up_args=("--kv-cache-gb", "0.5"), tandem_backend="tandem-grpc")
    co = make_deployment("colocated", cfg)
    argv = co.argv()
    assert argv[argv.index("tandem.cli") + 1] == "up" and "--ready-json" in argv
    at = argv.index("--mode")
    assert argv[at:] == ["--mode", "colocated", "--colocated", "1", "--model", "m", "--dtype", "auto",
                         "--kv-cache-gb", "0.5"]
    argv = make_deployment("colocated-dp2", cfg).argv()
    assert argv[argv.index("--mode"):][:4] == ["--mode", "colocated", "--colocated", "2"]
    argv = make_deployment("2p3d", cfg).argv()
    at = argv.index("--mode")
    assert argv[at:at + 6] == ["--mode", "disagg", "--prefill", "2", "--decode", "3"]
    peer = make_deployment("transformers", cfg)
    argv = peer.argv("transformers", "/models/m")
    assert argv[:3] == ["transformers", "serve", "/models/m"] and "--continuous-batching" in argv
    assert 0.005 <= float(argv[argv.index("--cb-max-memory-percent") + 1]) <= 0.6
    argv = co.argv()
    assert argv[argv.index("--gateway-port") + 1] == "-1"
    http = make_deployment("1p1d", SweepConfig(tandem_backend="openai-http")).argv()
    assert http[http.index("--gateway-port") + 1] == "0"
    for bad in ("3p", "colocated-dp", "colocated-2"):
        with pytest.raises(ValueError, match="unknown deployment"):
            make_deployment(bad, cfg)
    assert math.isinf(floats("1,inf")[1])
