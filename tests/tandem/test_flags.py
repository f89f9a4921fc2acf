"""Every flag is declared once (services/common/flags.py). Walking every parser of `tandem` (each
subcommand, `bench serve|sweep`) and of `python -m tandem.services.router|gateway`, each option string comes
from exactly one declaration: a `Flag`, or for a flag added by hand (bench, generate) one
`add_argument` call. The exceptions are names that mean different things in different commands,
listed here with each meaning (one declaration each)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict

import pytest

from tandem.services.common.flags import OWNER_ORDER, Flag, Owner, declaration_of, flags_of, owner_names

# option -> {who declares it (a Flag's owners, or the module of a hand-made flag): what it is there}
HOMONYMS: dict[str, dict[str, str]] = {
    "--prefill": {"launcher": "how many prefill workers `tandem up` starts",
                  "router": "static prefill worker addresses"},
    "--decode": {"launcher": "how many decode workers `tandem up` starts",
                 "router": "static decode worker addresses"},
    "--colocated": {"launcher": "how many co-located workers `tandem up` starts",
                    "router": "static co-located worker addresses"},
    "--cpu-cores": {"launcher": "`tandem up`'s placement of every worker (auto, one list per worker)",
                    "workers": "the cores of one worker"},
    "--api-key": {"launcher+router+gateway": "the key a server requires",
                  "tandem.cli.bench_cmd": "the key a load generator sends"},
    "--tokenizer": {"gateway": "where the gateway loads the served model's tokenizer from",
                    "tandem.cli.bench_cmd": "what the load generator counts tokens with"},
    "--seed": {"tandem.cli.generate_cmd": "the sampling seed", "tandem.cli.bench_cmd": "the workload's seed"},
    "--temperature": {"tandem.cli.generate_cmd": "sampling temperature (default: the model's)",
                      "tandem.cli.bench_cmd": "every request's temperature in a load test (default: greedy)"},
}


def _walk(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _walk(child)


def _build_parsers(monkeypatch) -> tuple[list[argparse.ArgumentParser], dict[int, tuple[str, int]]]:
    """Every parser, and for each flag added by hand where it was added (module, line)."""
    sites: dict[int, tuple[str, int]] = {}
    add = argparse._ActionsContainer.add_argument

    def recording(self, *args, **kwargs):
        action = add(self, *args, **kwargs)
        caller = sys._getframe(1)
        sites[id(action)] = (caller.f_globals["__name__"], caller.f_lineno)
        return action

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", recording)
    from tandem.cli.main import build_parser
    from tandem.services.gateway.__main__ import parser as gateway_main
    from tandem.services.router.__main__ import parser as router_main

    return [*_walk(build_parser()), router_main(), gateway_main()], sites


def repeated_declarations(monkeypatch) -> dict[str, list[str]]:
    """option -> who declares it, for every option declared more than once (homonyms: other than listed)."""
    parsers, sites = _build_parsers(monkeypatch)
    declared: dict[str, set] = defaultdict(set)
    for parser in parsers:
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            flag = declaration_of(action)
            # A Flag is one declaration wherever it is added; a hand-made flag, one per add_argument call.
            key = flag if flag is not None else sites[id(action)]
            for option in action.option_strings:
                declared[option].add(key)
    out = {}
    for option, keys in declared.items():
        who = sorted(owner_names(k.owners) if isinstance(k, Flag) else k[0] for k in keys)
        if who != sorted(HOMONYMS.get(option, who[:1])):
            out[option] = who
    return out


def test_each_flag_is_declared_once(monkeypatch):
    assert repeated_declarations(monkeypatch) == {}


def test_a_copied_flag_is_caught(monkeypatch):
    # What `tandem up` did before: its own --bootstrap-timeout with a literal default.
    import tandem.cli.up_cmd as up_cmd

    real = up_cmd.up_flags

    def with_a_copy() -> list[Flag]:
        return [dataclasses.replace(f, owners=Owner.LAUNCHER, field=None, default=30.0)
                if f.name == "--bootstrap-timeout" else f for f in real()]

    monkeypatch.setattr(up_cmd, "up_flags", with_a_copy)
    assert repeated_declarations(monkeypatch) == {"--bootstrap-timeout": ["launcher", "workers"]}


def test_a_flag_added_again_by_hand_is_caught(monkeypatch):
    # What the router did before: its own --max-queued-requests beside the engine's.
    import tandem.services.router.config as router_config

    flags = tuple(f for f in router_config.ROUTER_FLAGS if f.name != "--max-queued-requests")
    real = router_config.add_arguments

    def by_hand(p: argparse.ArgumentParser) -> None:
        monkeypatch.setattr(router_config, "ROUTER_FLAGS", flags)
        real(p)
        p.add_argument("--max-queued-requests", type=int, default=0, help="requests waiting for a slot")

    monkeypatch.setattr(router_config, "add_arguments", by_hand)
    assert repeated_declarations(monkeypatch) == {"--max-queued-requests": ["engine+router", __name__]}


def _all_flags() -> list[Flag]:
    from tandem.cli.up_cmd import up_flags

    parsers = [p for p in _walk(__import__("tandem.cli.main").cli.main.build_parser())]
    return list({id(f): f for p in parsers for f in flags_of(p)}.values()) + up_flags()


def test_defaults_come_from_each_owners_config():
    from tandem.cli.main import build_parser
    from tandem.cli.up_cmd import _configs
    from tandem.engine.config import EngineConfig
    from tandem.services.gateway.config import GatewayConfig
    from tandem.services.router.config import RouterConfig
    from tandem.services.worker.config import WorkerConfig

    configs = _configs()
    for flag in _all_flags():
        for owner in OWNER_ORDER:
            if flag.field and owner & flag.owners:   # the field exists in every owner's config
                flag.default_in({owner: configs[owner]})
    parse = build_parser().parse_args
    assert parse(["up"]).bootstrap_timeout == WorkerConfig(role="").bootstrap_timeout_s
    assert parse(["up"]).drain_timeout == parse(["decode"]).drain_timeout == WorkerConfig(role="").drain_timeout_s
    assert parse(["router"]).drain_timeout == RouterConfig().drain_timeout_s
    assert parse(["gateway"]).drain_timeout == GatewayConfig().drain_timeout_s
    assert parse(["router"]).max_queued_requests == RouterConfig().max_queued_requests
    assert parse(["up"]).max_queued_requests == parse(["prefill"]).max_queued_requests == \
        EngineConfig().max_queued_requests
    assert parse(["router"]).model == "" and parse(["up"]).model == EngineConfig().model


def test_up_takes_every_flag_of_its_children_but_their_placement():
    from tandem.cli.main import build_parser

    parsers = {p.prog.split()[-1]: p for p in _walk(build_parser())}
    up = {s for a in parsers["up"]._actions for s in a.option_strings}
    for child in ("prefill", "router", "gateway"):
        taken = {s for f in flags_of(parsers[child]) if f.up_targets for s in (*f.names, *f.off)}
        assert taken <= up, (child, taken - up)
    left = {f.name for child in ("prefill", "router", "gateway") for f in flags_of(parsers[child]) if not f.up_targets}
    assert left == {"--advertise-host", "--worker-id", "--pod-uid", "--cpu-cores", "--metrics-port", "--discovery",
                    "--k8s-namespace", "--k8s-selector", "--k8s-api-server", "--registry-prefix", "--prefill",
                    "--decode", "--colocated", "--probe-interval", "--router"}


@pytest.mark.parametrize("name", ["router", "gateway"])
def test_python_m_services_is_the_tandem_subcommand(name):
    import importlib

    from tandem.cli.main import build_parser

    sub = next(p for p in _walk(build_parser()) if p.prog == f"tandem {name}")
    alone = importlib.import_module(f"tandem.services.{name}.__main__").parser()

    def described(p: argparse.ArgumentParser) -> dict:
        return {a.option_strings[0]: (a.default, a.help, a.type, declaration_of(a)) for a in p._actions
                if a.option_strings and not isinstance(a, argparse._HelpAction)}

    assert described(alone) == {**described(sub), "--log-level": described(build_parser())["--log-level"]}


def test_kv_tier_flags_reach_the_engine_config_and_default_off():
    from tandem.cli.engine_args import engine_config_from_args
    from tandem.cli.main import build_parser
    from tandem.engine.config import EngineConfig
    from tandem.engine.errors import InvalidRequest

    parse = build_parser().parse_args
    off = engine_config_from_args(parse(["colocated"]))
    assert not off.kv_tiers_enabled and not EngineConfig().kv_tiers_enabled
    assert (off.kv_host_cache_gb, off.kv_disk_cache_dir, off.kv_disk_cache_gb) == (0.0, None, 16.0)
    on = engine_config_from_args(parse(["colocated", "--kv-host-cache-gb", "2", "--kv-disk-cache-dir", "/d",
                                        "--kv-disk-cache-gb", "3"]))
    assert (on.kv_host_cache_gb, on.kv_disk_cache_dir, on.kv_disk_cache_gb) == (2.0, "/d", 3.0)
    assert on.kv_tiers_enabled
    assert parse(["up", "--kv-disk-cache-dir", "/d"]).kv_disk_cache_dir == "/d"
    assert off.kv_write_policy == "write_through"
    assert engine_config_from_args(parse(["colocated", "--kv-write-policy", "write_back"])).kv_write_policy == "write_back"
    assert parse(["up", "--kv-write-policy", "write_back"]).kv_write_policy == "write_back"
    with pytest.raises(InvalidRequest, match="--kv-write-policy"):
        EngineConfig(kv_write_policy="lazy").validate()


def test_kv_events_flag_defaults_to_on_with_redis_and_tandem_up_forwards_it():
    from tandem.cli.main import build_parser
    from tandem.cli.up_cmd import worker_args
    from tandem.services.worker.config import WorkerConfig

    parse = build_parser().parse_args
    assert parse(["colocated"]).kv_events is None          # decided at start: on with a Redis registry
    assert WorkerConfig(role="colocated", redis_url="unix:///r.sock").publishes_kv_events
    assert not WorkerConfig(role="colocated").publishes_kv_events      # static / Kubernetes discovery
    assert not WorkerConfig(role="colocated", redis_url="unix:///r.sock", kv_events=False).publishes_kv_events
    assert parse(["decode", "--no-kv-events"]).kv_events is False
    assert "--no-kv-events" in worker_args(parse(["up", "--no-kv-events"]))
    assert "kv-events" not in " ".join(worker_args(parse(["up"])))
