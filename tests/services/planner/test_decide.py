"""Planner decisions on constructed metric histories, and its hysteresis."""

from __future__ import annotations

from dataclasses import replace

from tandem.services.planner.config import PlannerConfig
from tandem.services.planner.decide import Planner
from tandem.services.planner.shape import Shape
from tests.services.planner.helpers import FakeActuator, obs

HOST = PlannerConfig(target="host", redis_url="redis://x", router_metrics_url="http://x", ttft_slo_s=2.0,
                     itl_slo_s=0.1, stable_intervals=1, cooldown_s=0.0)
SCALE = replace(HOST, target="metrics", min_prefill=1, max_prefill=6, max_decode=6)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _run(planner: Planner, history, clock: Clock | None = None):
    """Step through `history`, applying reshapes as the planner's process does."""
    out = []
    for o in history:
        if clock is not None:
            clock.t += planner.cfg.interval_s
        d = planner.step(o)
        if d.action == "reshape":
            planner.actuator.apply(d.desired, d.reason)
        out.append(d)
    return out


def test_a_rate_ramp_wants_more_capacity():
    act = FakeActuator(Shape(1, 1))
    planner = Planner(SCALE, act, Clock())
    decisions = _run(planner, [obs(r, shape=act.shape or Shape(1, 1)) for r in (0.3, 0.3, 1.0, 2.0, 3.0, 4.0, 4.0)])
    assert decisions[0].action == "keep"
    assert act.applied and act.shape.workers > 2
    final = decisions[-1].scores[str(act.shape)]
    assert final["feasible"], decisions[-1].to_json()
    # Enough prefill capacity for 4 req/s of 256-token prompts at 1.5 ms a token (ρ < 1 per worker).
    assert act.shape.prefill >= 2


def test_long_prompts_want_prefill_and_long_outputs_want_decode():
    disagg = replace(HOST, min_prefill=1)   # which role the 4 workers take (0P4D: every one does both)
    prompts = Planner(disagg, FakeActuator(Shape(1, 3)))
    d = prompts.step(obs(0.8, prompt=800, output=16, shape=Shape(1, 3)))
    assert d.action == "reshape" and d.desired.prefill >= 2, d.reason

    outputs = Planner(disagg, FakeActuator(Shape(3, 1)))
    d = outputs.step(obs(1.5, prompt=32, output=400, shape=Shape(3, 1)))
    assert d.action == "reshape" and d.desired.decode >= 2, d.reason


def test_at_low_load_the_shape_with_the_better_ttft():
    planner = Planner(replace(HOST, ttft_slo_s=1.0, margin=0.02), FakeActuator(Shape(0, 2)))
    d = planner.step(obs(0.3, shape=Shape(0, 2)))
    scores = d.scores
    assert scores["1P1D"]["ttft"] < scores["0P2D"]["ttft"]
    assert d.action == "reshape" and d.desired == Shape(1, 1), d.reason


def test_at_high_load_two_colocated_serve_more_than_1p1d():
    planner = Planner(HOST, FakeActuator(Shape(1, 1)))
    d = planner.step(obs(2.0, shape=Shape(1, 1)))
    assert d.scores["0P2D"]["ttft"] < d.scores["1P1D"]["ttft"]
    assert d.desired == Shape(0, 2)


def test_host_candidates_keep_the_number_of_workers_and_the_bounds():
    planner = Planner(replace(HOST, max_prefill=2), FakeActuator(Shape(1, 3)))
    assert planner.candidates(Shape(1, 3)) == [Shape(0, 4), Shape(1, 3), Shape(2, 2)]
    k8s = FakeActuator(Shape(1, 1))
    k8s.min_prefill = 1   # an actuator that cannot run co-located shapes says so
    assert min(s.prefill for s in Planner(replace(SCALE, min_prefill=0), k8s).candidates(Shape(1, 1))) == 1


def test_load_oscillating_around_a_boundary_does_not_flap():
    cfg = replace(HOST, stable_intervals=3)
    act = FakeActuator(Shape(1, 1))
    planner = Planner(cfg, act, Clock())
    history = [obs(r, shape=Shape(1, 1)) for r in (0.3, 2.0) * 8]
    decisions = _run(planner, history)
    assert not act.applied
    assert {d.action for d in decisions} <= {"keep", "hold"}
    assert any(d.action == "hold" for d in decisions)


def test_a_steady_winner_reshapes_after_the_stable_intervals():
    act = FakeActuator(Shape(1, 1))
    planner = Planner(replace(HOST, stable_intervals=3), act, Clock())
    actions = [d.action for d in _run(planner, [obs(2.0, shape=Shape(1, 1))] * 3)]
    assert actions == ["hold", "hold", "reshape"] and act.applied == [Shape(0, 2)]


def test_cooldown_holds_a_second_reshape():
    clock = Clock()
    act = FakeActuator(Shape(1, 1))
    planner = Planner(replace(HOST, cooldown_s=300.0, ttft_slo_s=1.0, margin=0.01), act, clock)
    assert _run(planner, [obs(2.0, shape=Shape(1, 1))], clock)[-1].action == "reshape"
    later = _run(planner, [obs(0.3, shape=Shape(0, 2))] * 8, clock)   # the load falls at once
    assert "reshape" not in {d.action for d in later}
    assert later[-1].action == "hold" and "cooldown" in later[-1].reason and later[-1].desired == Shape(1, 1)
    clock.t += 300
    assert _run(planner, [obs(0.3, shape=Shape(0, 2))])[-1].action == "reshape"
    assert act.applied == [Shape(0, 2), Shape(1, 1)]


def test_nothing_while_the_actuator_is_busy():
    act = FakeActuator(Shape(1, 1))
    act.is_busy = True
    planner = Planner(HOST, act)
    d = planner.step(obs(2.0, shape=Shape(1, 1)))
    assert d.action == "hold" and "being applied" in d.reason and not act.applied


def test_without_step_costs_or_load_it_keeps_and_says_why():
    planner = Planner(HOST, FakeActuator(Shape(1, 1)))
    d = planner.step(obs(1.0, step_costs={}))
    assert d.action == "keep" and "fit" in d.reason
    d = planner.step(replace(obs(1.0), prompt_tokens=None, output_tokens=None, finished=0))
    assert d.action == "keep"


def test_scale_out_picks_the_fewest_feasible_workers_and_scales_in_with_margin():
    act = FakeActuator(Shape(3, 3))
    planner = Planner(SCALE, act)
    d = planner.step(obs(0.3, shape=Shape(3, 3)))
    assert d.action == "reshape" and d.desired == Shape(1, 1), d.reason
    feasible = [s for s, c in d.scores.items() if c["feasible"]]
    assert all(Shape.parse(s).workers >= 2 for s in feasible)


def test_the_correction_learns_from_the_running_shape_and_lends_it_within_its_kind():
    act = FakeActuator(Shape(1, 3))
    planner = Planner(replace(HOST, stable_intervals=50), act)
    first = planner.step(obs(0.5, shape=Shape(1, 3))).scores
    for _ in range(10):   # measured ITL twice the model's
        planner.step(obs(0.5, shape=Shape(1, 3), itl_mean=2 * first["1P3D"]["itl"], itl_samples=100))
    assert 1.8 < planner.correction(Shape(1, 3))[1].value < 2.2
    after = planner.step(obs(0.5, shape=Shape(1, 3))).scores
    assert after["2P2D"]["itl"] > 1.5 * first["2P2D"]["itl"]   # lent to the shapes with prefill workers
    assert after["0P4D"]["itl"] == first["0P4D"]["itl"]         # not to the co-located one: another kind



def test_a_shape_that_measures_worse_than_predicted_is_left_at_once_and_not_tried_again():
    """1P1D misses its TTFT SLO at 2 req/s and the formulas say 0P2D would meet both; once there,
    0P2D's ITL comes out twice its SLO. After `stable_intervals` on it the planner goes back (the
    cooldown does not hold a measured regret) and from then on judges 0P2D by what it did."""
    cfg = replace(HOST, stable_intervals=2, cooldown_s=600.0)
    act, clock = FakeActuator(Shape(1, 1)), Clock()
    planner = Planner(cfg, act, clock)
    real = {Shape(1, 1): dict(ttft_p90=2.4, itl_mean=0.05), Shape(0, 2): dict(ttft_p90=1.2, itl_mean=0.2)}
    history = []

    def step():
        clock.t += cfg.interval_s
        d = planner.step(obs(2.0, shape=act.shape, ttft_samples=50, itl_samples=200, **real[act.shape]))
        if d.action == "reshape":
            act.apply(d.desired, d.reason)
        history.append(d)
        return d

    for _ in range(12):
        step()
    assert act.applied == [Shape(0, 2), Shape(1, 1)], [d.reason for d in history]
    back = [d for d in history if d.action == "reshape"][1]
    assert "measured worse" in back.reason, back.reason
    assert clock.t - 1000.0 < cfg.cooldown_s           # it did not wait for the cooldown
    assert planner.correction(Shape(0, 2))[1].value > 1.5
    assert history[-1].action == "keep", history[-1].reason   # 0P2D stays out at the same load


def test_a_regret_is_not_itself_regretted_before_the_cooldown():
    """Both shapes measure worse than they were chosen with (a load neither serves): one move, one
    measured return, then the cooldown holds — no ping-pong on regrets."""
    cfg = replace(HOST, stable_intervals=2, cooldown_s=600.0)
    act, clock = FakeActuator(Shape(1, 1)), Clock()
    planner = Planner(cfg, act, clock)
    real = {Shape(1, 1): dict(ttft_p90=2.4, itl_mean=0.05), Shape(0, 2): dict(ttft_p90=1.2, itl_mean=0.2)}
    for _ in range(30):
        clock.t += cfg.interval_s
        if act.applied == [Shape(0, 2), Shape(1, 1)]:   # back on 1P1D, which now measures far worse
            real[Shape(1, 1)] = dict(ttft_p90=8.0, itl_mean=0.3)
        d = planner.step(obs(2.0, shape=act.shape, ttft_samples=50, itl_samples=200, **real[act.shape]))
        if d.action == "reshape":
            act.apply(d.desired, d.reason)
    assert act.applied[:2] == [Shape(0, 2), Shape(1, 1)]
    assert len(act.applied) == 2 or clock.t - 1000.0 >= cfg.cooldown_s, act.applied


def test_the_running_shape_is_judged_by_what_it_measures_not_by_the_formulas():
    """At 5 req/s of 256-token prompts the formulas say one prefill worker cannot keep up (ρ > 1), but
    1P1D measures TTFT 1.0 s and ITL 50 ms (the router's local route takes the overflow): it stays."""
    act = FakeActuator(Shape(1, 1))
    planner = Planner(replace(HOST, stable_intervals=3), act, Clock())
    first = planner.step(obs(5.0, shape=Shape(1, 1), ttft_p90=1.0, itl_mean=0.05, ttft_samples=50, itl_samples=500))
    assert first.scores["1P1D"]["ttft"] is None   # the formulas alone: cannot keep up
    decisions = [planner.step(obs(5.0, shape=Shape(1, 1), ttft_p90=1.0, itl_mean=0.05, ttft_samples=50,
                                  itl_samples=500)) for _ in range(6)]
    assert not act.applied, [d.reason for d in decisions]
    last = decisions[-1].scores["1P1D"]
    assert last["measured"] and last["feasible"] and last["ttft"] == 1.0
    # At a load it never ran at, the formulas answer again.
    assert planner.measured_at(Shape(1, 1), replace(planner.last_load, rate=10.0)) is None
