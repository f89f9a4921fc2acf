"""The scheduling flags reach every worker and the router, from their own commands and from `tandem up`."""

from __future__ import annotations

from tandem.cli.engine_args import engine_config_from_args
from tandem.cli.main import build_parser
from tandem.cli.up_cmd import router_args, worker_args
from tandem.services.router.config import RouterConfig

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
    worker = build_parser().parse_args(["decode", *worker_args(args)])
    assert engine_config_from_args(worker).max_queued_requests == 7 and worker.watchdog_timeout == 9
    assert worker.enable_priority_scheduling and worker.low_priority_values_first
    router = RouterConfig.from_args(build_parser().parse_args(["router", "--prefill", "a:1", "--decode", "b:2",
                                                                *router_args(args)]))
    assert (router.max_queued_requests, router.enable_priority_scheduling, router.low_priority_values_first) == \
        (7, True, True)
    traced = build_parser().parse_args(["colocated", *worker_args(build_parser().parse_args(
        ["up", "--step-trace-dir", "/tmp/steps"]))])
    assert traced.step_trace_dir == "/tmp/steps"
    # Not given: the router keeps its own default (no queue), the workers theirs.
    default = build_parser().parse_args(["up"])
    assert "--max-queued-requests" not in router_args(default)
    assert "--watchdog-timeout" not in worker_args(default) and "--step-trace-dir" not in worker_args(default)


def test_up_forwards_every_engine_flag_to_workers():
    # Each engine flag set to a non-default value on `tandem up` arrives in the worker's EngineConfig
    # (a flag added to add_engine_arguments is forwarded without touching up_cmd).
    import argparse
    import dataclasses

    from tandem.cli.engine_args import add_engine_arguments
    from tandem.engine.config import EngineConfig

    values = {"--model": "/m", "--dtype": "float32", "--device": "cpu", "--attention-backend": "torch",
              "--page-size": "8", "--max-total-tokens": "512", "--kv-cache-gb": "0.5", "--context-length": "300",
              "--max-running-requests": "5", "--chunked-prefill-size": "64", "--mixed-chunk-itl-factor": "2.5",
              "--mixed-chunk-ttft-target": "0.5", "--max-queued-requests": "9", "--priority-preemption-threshold": "4",
              "--num-threads": "1", "--graph-max-bs": "3", "--graph-bs": "1,3",
              "--prefill-schedule-policy": "fcfs", "--prefill-max-wait": "0.5",
              "--speculative-algorithm": "draft", "--speculative-num-draft-tokens": "3",
              "--speculative-ngram-min": "1", "--speculative-ngram-max": "6", "--speculative-draft-model": "/d",
              "--kv-host-cache-gb": "0.25", "--kv-disk-cache-dir": "/kv", "--kv-disk-cache-gb": "2",
              "--kv-write-policy": "write_back", "--kv-layout": "layer_first", "--lora-modules": "a=/x", "--max-loras": "2", "--max-lora-rank": "8",
              "--max-cpu-loras": "3"}
    switches = ["--disable-mixed-chunk", "--disable-prefix-cache", "--enable-priority-scheduling",
                "--low-priority-values-first", "--enable-overlap-schedule", "--enable-graph",
                "--disable-speculative-adaptive", "--disable-weight-prepack", "--disable-cpu-kernels",
                "--enable-any-whitespace", "--enable-lora", "--lora-eager-load", "--enable-lora-runtime-updating"]
    probe = argparse.ArgumentParser()
    add_engine_arguments(probe)
    named = {a.option_strings[0] for a in probe._actions if a.option_strings and a.dest != "help"}
    # Each mutually exclusive pair is covered by one of its two flags.
    assert named - {"--enable-mixed-chunk", "--disable-overlap-schedule", "--disable-graph",
                    "--enable-weight-prepack", "--enable-cpu-kernels", "--disable-any-whitespace",
                    "--disable-lora"} == \
        set(values) | set(switches), "a new engine flag needs a value here"
    argv = [x for kv in values.items() for x in kv] + switches
    up = build_parser().parse_args(["up", *argv])
    worker = engine_config_from_args(build_parser().parse_args(["colocated", *worker_args(up)]))
    assert worker == engine_config_from_args(build_parser().parse_args(["colocated", *argv]))
    default = dataclasses.asdict(EngineConfig())
    no_flag = {"seed", "init_new_token_ratio", "min_new_token_ratio", "new_token_ratio_decay_steps"}
    assert all(v != default[k] for k, v in dataclasses.asdict(worker).items() if k not in no_flag), worker


def test_up_forwards_the_routing_flags_to_the_router():
    from tandem.services.router.route_config import RouteConfig

    flags = ["--local-prefill-max-tokens", "-1", "--max-prefill-queue-tokens", "100", "--balance-abs-threshold",
             "3", "--balance-rel-threshold", "2.5", "--prefix-cache-ttl", "7"]
    args = build_parser().parse_args(["up", "--policy", "cache_aware", *flags])
    router = RouterConfig.from_args(build_parser().parse_args(["router", "--prefill", "a:1", "--decode", "b:2",
                                                                "--policy", args.policy, *router_args(args)]))
    assert router.policy == "cache_aware"
    assert router.route == RouteConfig(-1, 100, 3, 2.5, 7.0)
    assert not set(router_args(build_parser().parse_args(["up"]))) & set(flags[::2])  # defaults: the router's own


def test_up_forwards_lora_runtime_updating_to_the_workers_and_the_gateway():
    from tandem.cli.up_cmd import gateway_args
    from tandem.services.gateway.config import GatewayConfig

    up = build_parser().parse_args(["up", "--enable-lora", "--enable-lora-runtime-updating"])
    worker = engine_config_from_args(build_parser().parse_args(["colocated", *worker_args(up)]))
    assert worker.enable_lora_runtime_updating and not worker.lora_eager_load
    gateway = GatewayConfig.from_args(build_parser().parse_args(["gateway", *gateway_args(up)]))
    assert gateway.enable_lora_runtime_updating
    default = build_parser().parse_args(["up"])
    assert not GatewayConfig.from_args(build_parser().parse_args(["gateway", *gateway_args(default)])) \
        .enable_lora_runtime_updating
    assert "--enable-lora-runtime-updating" not in worker_args(default)
