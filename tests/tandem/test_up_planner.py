"""`tandem up --planner`: the router serves with no prefill worker (unless told otherwise), the planner
gets the planner flags the user set, and acts on this launcher through its Redis."""

from __future__ import annotations

import argparse

from tandem.cli import up_cmd
from tandem.services.launcher.shaping import planner_argv, serves_without_prefill


def _up(*argv: str):
    p = argparse.ArgumentParser()
    up_cmd.add_arguments(p)
    return up_cmd.up_config(p.parse_args(list(argv)))


def test_the_planner_gets_its_flags_and_the_router_serves_without_prefill_workers():
    cfg = _up("--planner", "--ttft-slo", "1.5", "--planner-cooldown", "30", "--policy", "least_load")
    assert cfg.planner
    assert cfg.router_args[-2:] == ("--min-prefill-workers", "0") and "--policy" in cfg.router_args
    assert serves_without_prefill(cfg.router_args)
    assert set(cfg.planner_args) == {"--ttft-slo", "1.5", "--planner-cooldown", "30.0"}
    assert "--ttft-slo" not in cfg.router_args and "--ttft-slo" not in cfg.worker_args
    argv = planner_argv(cfg, "unix:///tmp/r.sock", 9464)
    assert argv[0] == "planner" and argv[1:5] == list(cfg.planner_args)
    assert argv[5:] == ["--planner-target", "host", "--redis-url", "unix:///tmp/r.sock",
                        "--router-metrics-url", "http://127.0.0.1:9464/metrics"]


def test_the_users_min_prefill_workers_wins_and_without_planner_nothing_changes():
    cfg = _up("--planner", "--min-prefill-workers", "2")
    assert list(cfg.router_args).count("--min-prefill-workers") == 1 and not serves_without_prefill(cfg.router_args)
    plain = _up()
    assert not plain.planner and not plain.planner_args and "--min-prefill-workers" not in plain.router_args
    assert not serves_without_prefill(plain.router_args)
    assert serves_without_prefill(("--min-prefill-workers=0",))


def test_the_planner_needs_disagg_mode(capsys):
    p = argparse.ArgumentParser()
    up_cmd.add_arguments(p)
    assert up_cmd.run(p.parse_args(["--planner", "--mode", "colocated"])) == 2
    assert "--planner moves workers between the prefill and decode roles" in capsys.readouterr().out


def test_no_prefill_worker_at_start_needs_a_router_that_serves_without_one(capsys):
    p = argparse.ArgumentParser()
    up_cmd.add_arguments(p)
    assert up_cmd.run(p.parse_args(["--prefill", "0", "--decode", "2"])) == 2
    assert "--prefill 0 needs a router that serves without prefill workers" in capsys.readouterr().out
    assert up_cmd.run(p.parse_args(["--prefill", "-1", "--min-prefill-workers", "0"])) == 2
