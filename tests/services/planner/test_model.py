"""The capacity model's shape (monotone in load, capacity where it should be) and the load predictor."""

from __future__ import annotations

import math

import pytest

from tandem.services.planner.model import CapacityModel, Correction, Costs, NotFitted, wait_quantile
from tandem.services.planner.observe import StepCost
from tandem.services.planner.predict import Holt, Load, LoadPredictor
from tandem.services.planner.shape import Shape
from tests.services.planner.helpers import DECODE_FIT, PREFILL_FIT, obs

MODEL = CapacityModel(Costs.from_roles({"prefill": PREFILL_FIT, "decode": DECODE_FIT}))
SHAPES = [Shape(p, d) for p in range(0, 4) for d in range(1, 4)]


def _series(values):
    return all(b >= a for a, b in zip(values, values[1:], strict=False))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_latency_grows_with_rate_and_lengths(shape):
    rates = [0.1 * i for i in range(40)]
    for kind in ("ttft_s", "itl_s"):
        assert _series([getattr(MODEL.predict(shape, Load(r, 256, 64)), kind) for r in rates]), kind
        assert _series([getattr(MODEL.predict(shape, Load(0.8, li, 64)), kind) for li in range(16, 2048, 64)])
        assert _series([getattr(MODEL.predict(shape, Load(0.8, 256, lo)), kind) for lo in range(8, 1024, 32)])
    assert math.isinf(MODEL.predict(shape, Load(1000.0, 256, 64)).ttft_s)   # it saturates, then it says so


def test_more_workers_of_a_role_never_hurt_its_latency():
    load = Load(1.5, 512, 128)
    for p in range(1, 4):
        assert MODEL.predict(Shape(p + 1, 2), load).ttft_s <= MODEL.predict(Shape(p, 2), load).ttft_s
    for d in range(1, 4):
        assert MODEL.predict(Shape(1, d + 1), load).itl_s <= MODEL.predict(Shape(1, d), load).itl_s
        assert MODEL.predict(Shape(0, d + 1), load).ttft_s <= MODEL.predict(Shape(0, d), load).ttft_s


def test_the_decode_formula_is_littles_law():
    load = Load(2.0, 128, 100)
    itl = MODEL.predict(Shape(1, 2), load).itl_s
    rows = load.rate * load.output_tokens * itl / 2
    assert itl == pytest.approx(DECODE_FIT.base_s + DECODE_FIT.per_row_s * rows)


def test_a_backlog_costs_prefill_capacity():
    assert MODEL.predict(Shape(1, 1), Load(1.0, 256, 64, backlog_tokens=3000)).ttft_s > \
        MODEL.predict(Shape(1, 1), Load(1.0, 256, 64)).ttft_s


def test_costs_borrow_a_term_the_role_never_measured():
    costs = Costs.from_roles({"prefill": PREFILL_FIT, "decode": DECODE_FIT})
    assert costs.local_token_s == PREFILL_FIT.per_token_s     # the decode worker never prefilled
    colocated = Costs.from_roles({"colocated": StepCost(0.03, 0.002, 0.002)})
    assert colocated.prefill_token_s == colocated.local_token_s == 0.002
    with pytest.raises(NotFitted):
        Costs.from_roles({"prefill": PREFILL_FIT})
    with pytest.raises(NotFitted):
        Costs.from_roles({"decode": DECODE_FIT})


def test_wait_quantile_tail():
    assert wait_quantile(1.0, 0.05, 0.9) == 0.0        # 95% of prompts do not wait at all
    assert wait_quantile(1.0, 0.5, 0.9) == pytest.approx(2 * math.log(5))
    assert wait_quantile(1.0, 0.9, 0.99) > wait_quantile(1.0, 0.9, 0.9)


def test_correction_is_smoothed_and_bounded():
    c = Correction((0.5, 2.0), 0.5)
    c.update(10.0, 1.0)
    assert c.value == pytest.approx(math.sqrt(2.0))
    for _ in range(20):
        c.update(10.0, 1.0)
    assert c.value == pytest.approx(2.0)
    c.update(None, 1.0)
    c.update(1.0, math.inf)
    assert c.value == pytest.approx(2.0)


def test_holt_follows_a_ramp_and_never_forecasts_below_zero():
    h = Holt(0.5, 0.3)
    for x in range(10):
        h.update(float(x))
    assert 9.0 < h.forecast() < 11.0      # a step ahead of the last value, not behind it
    for _ in range(3):
        h.update(0.0)
    assert h.forecast() >= 0.0


def test_predictor_keeps_lengths_through_intervals_without_finished_requests():
    p = LoadPredictor()
    assert p.predict(obs(1.0)) is None
    p.update(obs(1.0, prompt=300, output=50, queued_prefill_tokens=77))
    p.update(obs(1.0, prompt=None, output=None))
    load = p.predict(obs(1.0, queued_prefill_tokens=77))
    assert (load.prompt_tokens, load.output_tokens, load.backlog_tokens) == (300, 50, 77)
