"""The scheduler simulation: step-cost fit, the event loop against hand-computed timelines, the CLI."""

from __future__ import annotations

import json

import pytest

from tandem.bench.sched_sim import StepCosts, engine_config, load_traces, main, simulate

FIXED = StepCosts(0.020, 0.002, 0.001)     # 20 ms + 2 ms per row + 1 ms per prefill token, no spread


def test_fit_recovers_the_costs_and_keeps_the_spread_per_kind(tmp_path):
    steps = [{"decode_tokens": r, "prefill_tokens": p, "seconds": FIXED.fitted(r, p) * f}
             for r, p, f in [(1, 0, 1.0), (4, 0, 1.0), (2, 16, 1.0), (0, 256, 1.0), (3, 32, 1.0), (2, 0, 1.0)]]
    c = StepCosts.fit(steps)
    assert (c.a, c.b, c.c) == pytest.approx((FIXED.a, FIXED.b, FIXED.c), rel=1e-6)
    assert c.decode_residuals == pytest.approx((1.0,) * 3) and len(c.prefill_residuals) == 3
    slow = steps * 20 + [{"decode_tokens": 1, "prefill_tokens": 0, "seconds": 0.044}]   # one decode step 2x slow
    assert max(StepCosts.fit(slow).decode_residuals) > 1.5
    (tmp_path / "w0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert load_traces([tmp_path]) == steps
    with pytest.raises(ValueError, match="no step traces"):
        load_traces([tmp_path / "empty"])
    with pytest.raises(ValueError, match="at least 3"):
        StepCosts.fit(steps[:2])


def test_one_request_timeline_is_the_step_costs():
    cfg = engine_config("--chunked-prefill-size 512")
    recs, window = simulate(cfg, [0.5], input_len=100, output_len=4, workers=1, costs=FIXED)
    (r,) = recs
    assert r.success and r.output_tokens == 4 and r.start == 0.5
    assert r.ttft == pytest.approx(0.020 + 0.100)              # one prefill step of 100 tokens
    assert r.itl == pytest.approx([0.022] * 3)                 # decode steps of one row
    assert window == pytest.approx(0.120 + 3 * 0.022)


def test_mixed_chunks_keep_the_running_request_streaming():
    # A long prompt arrives while a request decodes: without mixed chunks one 1000-token prefill step
    # stalls it (~1 s gap); with them its gaps stay near a decode step.
    arrivals = [0.0, 1.5]     # the first prefills for 1 s, then decodes until ~1.9 s
    plain, _ = simulate(engine_config("--disable-mixed-chunk"), arrivals, 1000, 40, 1, FIXED)
    mixed, _ = simulate(engine_config(""), arrivals, 1000, 40, 1, FIXED)
    assert max(plain[0].itl) > 0.9
    assert max(mixed[0].itl) < 0.2
    assert all(r.success for r in plain + mixed)


def test_two_workers_share_the_arrivals():
    recs, _ = simulate(engine_config(""), [0.0, 0.0], 100, 4, 2, FIXED)
    # Both start at once on their own worker: the same timeline as one request alone.
    assert [r.ttft for r in recs] == pytest.approx([0.120, 0.120])


def test_cli_replays_a_result_and_shows_the_measured_numbers(tmp_path, capsys):
    m = {"itl": {"percentiles": {"p50": 30.0, "p99": 60.0}}, "itl_p99_over_p50": 2.0,
         "ttft": {"percentiles": {"p50": 400.0}, "max": 900.0}, "good_requests": 3, "completed": 3, "goodput": 1.5}
    result = {"deployments": {"colocated-dp2": {"runs": [{"request_rate": "1", "metrics": m, "requests": [
        {"sent_ms": 0.0}, {"sent_ms": 500.0}, {"sent_ms": 900.0}]}]}}}
    (tmp_path / "real.json").write_text(json.dumps(result))
    out = tmp_path / "sim.json"
    assert main(["--step-cost", "20,2,1", "--replay", str(tmp_path / "real.json"), "--config", "a=",
                 "--config", "b=--disable-mixed-chunk", "--input-len", "64", "--output-len", "8",
                 "--out", str(out)]) == 0
    points = json.loads(out.read_text())["points"]
    assert [p["config"] for p in points] == ["measured", "a", "b"]
    assert all(p["completed"] == 3 for p in points[1:])
    assert "measured" in capsys.readouterr().out
    assert main(["--step-cost", "20,2,1", "--config", "x=--no-such-flag", "--num-prompts", "2"]) == 2
    assert "bad engine flags" in capsys.readouterr().err


def test_cli_fits_traces_and_can_drop_the_spread(tmp_path):
    steps = [{"decode_tokens": r, "prefill_tokens": p, "seconds": FIXED.fitted(r, p) * f}
             for r, p, f in [(1, 0, 1.0), (4, 0, 1.3), (2, 16, 1.0), (0, 256, 0.9), (3, 32, 1.1), (2, 0, 1.0)] * 5]
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / "colocated-0.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    for extra, spread in (([], True), (["--no-spread"], False)):
        out = tmp_path / "sim.json"
        assert main(["--trace", str(tmp_path / "steps"), "--num-prompts", "6", "--request-rates", "4",
                     "--seeds", "3", "--input-len", "32", "--output-len", "4", "--out", str(out), *extra]) == 0
        d = json.loads(out.read_text())
        assert (len(set(d["step_costs"]["decode_residuals"])) > 1) is spread
        assert [(p["config"], p["rate"], p["arrivals"], p["completed"]) for p in d["points"]] == \
            [("default", "4", "seed 3", 6)]
