"""StepCostModel.fit: the best fit of whatever steps were seen (what a worker reports to the planner)."""

import pytest

from tandem.engine.scheduler.step_cost import StepCostModel
from tandem.services.worker.convert import step_cost_to_pb


def _feed(cost: StepCostModel, steps) -> None:
    for tokens, rows in steps:
        cost.observe(tokens, rows, 0.010 + 0.002 * rows + 0.0005 * tokens)


def test_prefill_only_worker_reports_base_and_per_token_cost():
    cost = StepCostModel()
    _feed(cost, [(t, 0) for t in (64, 256, 128, 512, 32, 300)])
    assert cost.coefficients() is None  # the budgets still wait for decode steps
    a, b, c = cost.fit()
    assert b == 0.0
    assert a == pytest.approx(0.010, rel=1e-3) and c == pytest.approx(0.0005, rel=1e-3)


def test_decode_only_worker_reports_zero_prefill_cost():
    cost = StepCostModel()
    _feed(cost, [(0, r) for r in (1, 4, 2, 8, 3)])
    a, b, c = cost.fit()
    assert c == 0.0 and a == pytest.approx(0.010, rel=1e-3) and b == pytest.approx(0.002, rel=1e-3)


def test_same_size_steps_keep_their_measured_time():
    """Base and per-token cost cannot be told apart; the fit still predicts the size it saw."""
    cost = StepCostModel()
    _feed(cost, [(256, 0)] * 6)
    a, _, c = cost.fit()
    assert a + 256 * c == pytest.approx(0.010 + 0.0005 * 256, rel=1e-3)


def test_fit_equals_coefficients_once_both_kinds_were_seen():
    cost = StepCostModel()
    _feed(cost, [(64, 2), (0, 4), (256, 0), (0, 1), (128, 3)])
    assert cost.fit() == cost.coefficients()


def test_to_pb_unset_before_a_fit_then_carries_the_terms():
    cost = StepCostModel()
    _feed(cost, [(64, 0), (0, 2)])
    assert step_cost_to_pb(cost) is None
    _feed(cost, [(128, 1), (0, 3), (32, 0)])
    pb = step_cost_to_pb(cost)
    assert pb.steps == 5
    assert (pb.base_s, pb.per_decode_row_s, pb.per_prefill_token_s) == pytest.approx((0.010, 0.002, 0.0005), rel=1e-3)
