"""`tandem bench serve --load-profile`: the spec, the schedule, per-phase metrics and the time series
(pure Python), and the command end to end against a fake gRPC server (no model, no torch)."""

import argparse
import json

import pytest

from tandem.bench.serve import load_profile as lp
from tandem.bench.serve.datasets import DatasetConfig, build_dataset
from tandem.bench.serve.metrics import SLO
from tandem.bench.serve.records import RequestRecord
from tandem.cli import bench_cmd
from tests.bench.fakes import FakeServer, byte_level_bpe


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    byte_level_bpe().save(str(d / "tokenizer.json"))
    return d


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    return bench_cmd.run(parser.parse_args(list(argv)))


def test_spec_parses_phases_names_and_units_and_rejects_bad_ones():
    p = lp.parse_load_profile("90s@0.5:128/256, burst=2m@3:256/64,10@0:8/1")
    assert [(x.duration_s, x.rate, x.input_len, x.output_len) for x in p.phases] == [
        (90, 0.5, 128, 256), (120, 3, 256, 64), (10, 0, 8, 1)]
    assert p.names() == ["phase1", "burst", "phase3"] and p.duration_s == 220 and p.starts == [0, 90, 210]
    assert str(lp.parse_load_profile(str(p))) == str(p)                  # round trip
    assert p.phase_at(0) == 0 and p.phase_at(90) == 1 and p.phase_at(219.9) == 2 and p.phase_at(220) is None
    for bad in ("90s@0.5:128", "90s:0.5:128/256", "0s@1:8/8", "", "5s@1:0/8"):
        with pytest.raises(ValueError):
            lp.parse_load_profile(bad)


def test_json_file_profile(tmp_path):
    f = tmp_path / "profile.json"
    f.write_text(json.dumps({"phases": [{"name": "chat", "duration_s": 5, "rate": 1, "input_len": 16, "output_len": 32},
                                        {"duration": 3, "rate": 2, "input_len": 64, "output_len": 4}]}))
    p = lp.parse_load_profile(str(f))
    assert p.names() == ["chat", "phase2"] and p.duration_s == 8 and p.phases[1].rate == 2
    f.write_text(json.dumps([{"rate": 1}]))
    with pytest.raises(ValueError, match="needs duration_s"):
        lp.parse_load_profile(str(f))


def test_arrivals_follow_each_phase_and_depend_only_on_the_seed():
    p = lp.parse_load_profile("100s@0.5:8/8,100s@4:8/8,100s@0:8/8,100s@1:8/8")
    sched = lp.arrival_schedule(p, 1.0, seed=3)
    assert sched == lp.arrival_schedule(p, 1.0, seed=3) and sched != lp.arrival_schedule(p, 1.0, seed=4)
    assert [t for t, _ in sched] == sorted(t for t, _ in sched)
    assert all(p.phase_at(t) == k for t, k in sched)                    # each request is sent in its phase
    counts = [sum(1 for _, k in sched if k == i) for i in range(4)]
    assert 30 <= counts[0] <= 75 and 330 <= counts[1] <= 470 and counts[2] == 0 and 70 <= counts[3] <= 135


def test_requests_take_their_phases_lengths_in_schedule_order():
    tok = byte_level_bpe()
    p = lp.parse_load_profile("5s@4:6/3,5s@4:20/2")
    sched = lp.arrival_schedule(p, 1.0, seed=0)
    reqs = lp.build_requests(p, sched, DatasetConfig(seed=0), tok, build_dataset)
    assert [r.phase for r in reqs] == [k for _, k in sched]
    assert all((r.prompt_len, r.output_len) == ((6, 3) if r.phase == 0 else (20, 2)) for r in reqs)
    assert len({r.prompt for r in reqs}) == len(reqs)


def _rec(start, ttft, end, phase, ok=True, tokens=3):
    r = RequestRecord(prompt_len=4, output_len=tokens, start=start, end=end, success=ok, phase=phase)
    if ok:
        r.token_times = [start + ttft + i * (end - start - ttft) / max(1, tokens - 1) for i in range(tokens)]
        r.output_tokens = tokens
    else:
        r.error = "RESOURCE_EXHAUSTED: shed"
    return r


def test_phase_metrics_and_time_series_count_by_arrival_and_by_end():
    p = lp.parse_load_profile("10s@1:4/3,10s@2:4/3")
    t0 = 100.0
    recs = [_rec(t0 + 1, 0.5, t0 + 2, 0), _rec(t0 + 8, 3.0, t0 + 12, 0),     # slow one ends in the 2nd phase
            _rec(t0 + 11, 0.2, t0 + 11.5, 1), _rec(t0 + 15, 0, t0 + 15.1, 1, ok=False)]
    slo = SLO(ttft=1.0)
    phases = lp.phase_metrics(p, recs, slo, (50.0, 99.0))
    assert [(x.sent, x.metrics.completed, x.metrics.failed, x.metrics.good_requests) for x in phases] == [
        (2, 2, 0, 1), (2, 1, 1, 1)]
    assert phases[0].metrics.goodput == pytest.approx(0.1) and phases[1].to_dict()["spec"] == "10s@2:4/3"
    rows = lp.time_series(p, recs, t0, slo, window_s=5.0)
    assert [r["t_s"] for r in rows] == [0, 5, 10, 15]
    assert [r["offered_rate"] for r in rows] == [1, 1, 2, 2] and [r["phase"] for r in rows] == [0, 0, 1, 1]
    assert [r["sent"] for r in rows] == [1, 1, 1, 1]
    assert [(r["completed"], r["good"], r["failed"]) for r in rows] == [(1, 1, 0), (0, 0, 0), (2, 1, 0), (0, 0, 1)]
    assert rows[2]["goodput"] == pytest.approx(0.2)
    assert "phase2" in lp.format_phase_table(phases)


def test_serve_command_runs_a_load_profile(tokenizer_dir, tmp_path):
    out = tmp_path / "profile.json"
    with FakeServer(gap=0.001) as fake:
        rc = cli("serve", "--backend", "tandem-grpc", "--base-url", f"127.0.0.1:{fake.port}",
                 "--model", str(tokenizer_dir), "--load-profile", "short=1s@12:6/2,1s@6:24/3", "--num-warmups", "1",
                 "--slo", "ttft=5s", "--load-profile-window", "0.5", "--out", str(out), "--no-progress")
        sent = list(fake.servicer.requests)
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["config"]["load_profile"] == "short=1s@12:6/2,1s@6:24/3"
    (run,) = res["runs"]
    assert run["request_rate"] == "profile" and [ph["name"] for ph in run["phases"]] == ["short", "phase2"]
    n = [ph["sent"] for ph in run["phases"]]
    assert n[0] > 0 and n[1] > 0 and run["metrics"]["completed"] == sum(n) == len(sent) - 1
    assert all(ph["metrics"]["failed"] == 0 and ph["metrics"]["good_requests"] == ph["sent"] for ph in run["phases"])
    assert sorted(r["phase"] for r in run["requests"]) == [0] * n[0] + [1] * n[1]
    assert all(r["prompt_len"] == (6 if r["phase"] == 0 else 24) for r in run["requests"])
    assert sum(row["sent"] for row in run["time_series"]) == sum(n) and run["time_series"][0]["t_s"] == 0
    assert [len(r.token_ids.ids) for r in sent[1:]].count(24) == n[1]
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".profile.png").stat().st_size > 0 and out.with_suffix(".cdf.png").stat().st_size > 0


def test_serve_refuses_a_load_profile_with_request_rates(tokenizer_dir, capsys):
    assert cli("serve", "--model", str(tokenizer_dir), "--load-profile", "1s@1:4/4", "--request-rate", "2") == 2
    assert "leave out --request-rate" in capsys.readouterr().err
