"""`tandem planner`'s flags into PlannerConfig, and what it refuses."""

from __future__ import annotations

import pytest

from tandem.cli.main import build_parser
from tandem.services.planner.config import PlannerConfig


def _cfg(*argv: str) -> PlannerConfig:
    return PlannerConfig.from_args(build_parser().parse_args(["planner", *argv]))


def test_flags_fill_the_config():
    cfg = _cfg("--router-metrics-url", "http://r:9090/metrics", "--ttft-slo", "1.5", "--itl-slo", "0.05",
               "--planner-interval", "5", "--planner-cooldown", "30", "--planner-stable-intervals", "2",
               "--planner-min-prefill", "1", "--planner-max-prefill", "3", "--planner-min-decode", "2",
               "--planner-max-decode", "5", "--planner-target", "host", "--redis-url", "redis://h:1/0",
               "--metrics-port", "9999")
    assert (cfg.ttft_slo_s, cfg.itl_slo_s, cfg.interval_s, cfg.cooldown_s, cfg.stable_intervals) == \
        (1.5, 0.05, 5.0, 30.0, 2)
    assert (cfg.min_prefill, cfg.max_prefill, cfg.min_decode, cfg.max_decode) == (1, 3, 2, 5)
    assert (cfg.target, cfg.redis_url, cfg.metrics_port, cfg.fixed_total) == ("host", "redis://h:1/0", 9999, True)
    assert _cfg("--router-metrics-url", "http://r/metrics", "--planner-target", "kubernetes",
                "--prefill-deployment", "p", "--decode-deployment", "d").k8s.prefill_deployment == "p"


@pytest.mark.parametrize(("argv", "words"), [
    ((), "--router-metrics-url is required"),
    (("--planner-target", "host"), "needs --redis-url"),
    (("--ttft-slo", "0"), "--ttft-slo"),
    (("--planner-min-decode", "0"), "--planner-min-decode"),
    (("--planner-min-prefill", "3", "--planner-max-prefill", "2"), "--planner-min-prefill"),
    (("--planner-stable-intervals", "0"), "--planner-stable-intervals"),
])
def test_refused(argv, words):
    url = () if not argv else ("--router-metrics-url", "http://r/metrics")
    with pytest.raises(ValueError, match=words):
        _cfg(*url, *argv)
