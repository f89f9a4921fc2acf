"""The scheduling flags reach every worker and the router, from their own commands and from `tandem up`."""

from __future__ import annotations

from services.router.config import RouterConfig
from tandem.cli import build_parser
from tandem.engine_args import engine_config_from_args
from tandem.up_cmd import _engine_argv, _router_argv

FLAGS = ["--max-queued-requests", "7", "--enable-priority-scheduling", "--low-priority-values-first",
         "--priority-preemption-threshold", "3"]


def test_worker_flags_build_the_engine_config():
    for role in ("prefill", "decode", "colocated"):
        args = build_parser().parse_args([role, *FLAGS, "--watchdog-timeout", "9"])
        cfg = engine_config_from_args(args)
        assert (cfg.max_queued_requests, cfg.enable_priority_scheduling, cfg.low_priority_values_first,
                cfg.priority_preemption_threshold) == (7, True, True, 3)
        assert args.watchdog_timeout == 9


def test_up_forwards_them_to_workers_and_router():
    args = build_parser().parse_args(["up", *FLAGS, "--watchdog-timeout", "9"])
    worker = build_parser().parse_args(["decode", *_engine_argv(args)])
    assert engine_config_from_args(worker).max_queued_requests == 7 and worker.watchdog_timeout == 9
    assert worker.enable_priority_scheduling and worker.low_priority_values_first
    router = RouterConfig.from_args(build_parser().parse_args(["router", "--prefill", "a:1", "--decode", "b:2",
                                                                *_router_argv(args)]))
    assert (router.max_queued_requests, router.enable_priority_scheduling, router.low_priority_values_first) == \
        (7, True, True)
    # Not given: the router keeps its own default (no queue), the workers theirs.
    default = build_parser().parse_args(["up"])
    assert "--max-queued-requests" not in _router_argv(default)
    assert "--watchdog-timeout" not in _engine_argv(default)
