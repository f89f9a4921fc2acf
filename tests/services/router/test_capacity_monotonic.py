"""Capacity is monotonic in load (issue [25]): one arrival trace replayed at rising rates through a
simulated 1P1D deployment routed by the real planner (pd_sim.py) never attains a larger share of
requests within the SLO at a higher rate than at a lower one. Torch-free, deterministic, < 1 s."""

from __future__ import annotations

import functools

import pytest

from tandem.services.router.route_config import RouteConfig
from tests.services.router import pd_sim

RATES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5)   # req/s: from all within the SLO to far past capacity
SEEDS = (0, 1, 2, 3)
REQUESTS = 160
# A lower rate may trail a higher one by this much (3 of 160 requests): a request or two whose TTFT
# or TPOT lands a few ms either side of its bound as the arrivals stretch is not a trend; a routing
# rule that switches regimes with load (the 31% at 1 req/s against 100% at 2) moves tens.
TOLERANCE = 0.02
CFG = pd_sim.SimConfig()
DEFAULT, OLD_RULE = RouteConfig(), RouteConfig(local_prefill_max_itl_ms=0)


@functools.cache
def _outcomes(route: RouteConfig, seed: int, rate: float, requests: int = REQUESTS):
    return pd_sim.replay(pd_sim.poisson_gaps(requests, seed), rate, route, CFG, _keys(requests))


@functools.cache
def _keys(requests: int):
    return pd_sim.distinct_keys(requests, CFG.prompt_tokens)


def _share(route: RouteConfig, seed: int, rate: float, requests: int = REQUESTS) -> float:
    return pd_sim.slo_share(_outcomes(route, seed, rate, requests), CFG.output_tokens)


def _shares(route: RouteConfig, seed: int, requests: int = REQUESTS) -> list[float]:
    return [_share(route, seed, r, requests) for r in RATES]


def _inversions(shares: list[float]) -> list[tuple[float, float, float, float]]:
    """(lower rate, higher rate, their shares) wherever the lower rate did worse beyond TOLERANCE."""
    return [(RATES[i], RATES[j], shares[i], shares[j]) for i in range(len(RATES)) for j in range(i + 1, len(RATES))
            if shares[j] > shares[i] + TOLERANCE]


def _tpot_met(route: RouteConfig, seed: int, rate: float) -> float:
    outs = _outcomes(route, seed, rate)
    return sum((o.last - o.first) / (CFG.output_tokens - 1) <= pd_sim.Slo().tpot_s for o in outs) / len(outs)


def test_a_lone_request_is_timed_by_the_step_costs():
    """Both workers idle: the planner prefills on D (it starts no later than P), in one step of the
    whole prompt; then one decode step of one row per token."""
    [o] = pd_sim.replay([1.0], 1.0, DEFAULT, CFG)
    d = pd_sim.AVX2_DECODE
    assert o.route == "local"
    assert o.ttft_s == pytest.approx(d.step_s(0, CFG.prompt_tokens))
    assert (o.last - o.first) / (CFG.output_tokens - 1) == pytest.approx(d.step_s(1, 0))


@pytest.mark.parametrize("seed", SEEDS)
def test_capacity_is_monotonic_in_load(seed):
    shares = _shares(DEFAULT, seed)
    assert not _inversions(shares), [f"{s:.1%}" for s in shares]
    # The replay spans the whole range (a simulator where every rate is served, or none, passes the
    # check above trivially).
    assert shares[0] >= 0.95 and shares[-1] <= 0.10, shares


def test_the_check_fails_on_replays_as_short_as_one_benchmark_point():
    """The check above can fail: over 32 requests (what the benchmarks send per rate, `tandem bench
    sweep --num-prompts 32`) the same router attains more at a higher rate on some traces (9 and 22 pp
    on seeds 2 and 5), from sampling alone; so does the old rule. That is why the test replays 160, and
    why a capacity search over 32-request points can see a lower rate do worse with no rule at fault."""
    assert any(_inversions(_shares(DEFAULT, seed, requests=32)) for seed in range(10))


@pytest.mark.parametrize("seed", SEEDS)
def test_the_itl_bound_keeps_tpot_where_the_old_rule_breaks_it(seed):
    """Without the bound (--local-prefill-max-itl-ms 0, the rule of the issue's runs) D prefills a
    quarter to a third of the prompts at any load; at 1.5-2 req/s its batch grows to 10-30 running and
    its steps to 120-320 ms (the issue's runs: 15-26 running, 160-370 ms, at 1-1.5 req/s) and TPOT
    breaks. With it D stops taking prompts as its steps lengthen: TPOT holds, and what is lost past
    capacity is TTFT (P alone prefills ~1.5 req/s of these prompts)."""
    assert _tpot_met(DEFAULT, seed, 1.5) >= 0.8 > 0.6 >= _tpot_met(OLD_RULE, seed, 1.5)
    assert _share(DEFAULT, seed, 1.5) >= _share(OLD_RULE, seed, 1.5) + 0.1
    assert _tpot_met(DEFAULT, seed, 2.0) >= 0.9 > 0.1 >= _tpot_met(OLD_RULE, seed, 2.0)
