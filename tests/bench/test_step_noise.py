"""The step-noise statistic (torch-free): each step against the median of the steps around it."""

from __future__ import annotations

import pytest

from tandem.bench.step_noise import main, spread


def test_a_steady_step_has_no_spread_even_while_it_drifts():
    drifting = [0.030 + 0.00001 * i for i in range(200)]   # the context grows: steps get slower
    s = spread(drifting)
    assert s["steps"] == 200 and s["p99"] == pytest.approx(1.0, abs=0.01)
    assert s["p50_ms"] == pytest.approx(31.0, abs=0.1)


def test_outliers_show_in_the_tail():
    times = [0.030] * 200
    for i in range(0, 200, 50):          # 4 steps of 200, at twice the time
        times[i] = 0.060
    s = spread(times)
    assert s["p90"] == pytest.approx(1.0) and s["max"] == pytest.approx(2.0)
    assert s["p99"] == pytest.approx(2.0)   # 2% of the steps are slow: p99 is one of them


def test_too_few_steps_and_too_many_processes_are_refused(capsys):
    with pytest.raises(ValueError, match="at least 21"):
        spread([0.03] * 5)
    assert main(["--processes", "4096"]) == 2
    assert "cores" in capsys.readouterr().err
