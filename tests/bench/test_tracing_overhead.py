"""bench/tracing_overhead.py's report: medians per mode and on/off - 1 against the target."""

from __future__ import annotations

import pytest

from bench.tracing_overhead import run_order, summary


def run(traced: bool, ttft: float, tpot: float) -> dict:
    return {"traced": traced, "ttft_p50": ttft, "ttft_p99": 2 * ttft, "tpot_p50": tpot, "tpot_p99": 2 * tpot}


def test_overhead_is_on_over_off_medians():
    runs = [run(False, 100, 50), run(True, 101, 50.5), run(False, 102, 50), run(True, 103, 51.0)]
    s = summary(runs, 0.02)
    assert s["median"]["off"]["ttft_p50"] == 101 and s["median"]["on"]["ttft_p50"] == 102
    assert s["overhead"]["tpot_p50"] == pytest.approx(0.015)
    assert s["met"]
    assert not summary([run(False, 100, 50), run(True, 110, 50)], 0.02)["met"]


def test_rounds_alternate_which_mode_runs_first():
    assert run_order(3) == [False, True, True, False, False, True]
    assert run_order(1) == [False, True]
