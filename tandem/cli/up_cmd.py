"""`tandem up`: the whole stack on this machine (what `make run` runs).

It takes its own flags (services/launcher/config.py) and every flag of the processes it starts, each
from its one declaration (services/common/flags.py): the engine's and a worker's for the workers, the
router's, the gateway's. A child gets the flags declared for it that the user changed (`child_argv`);
the rest keep the child's own default, which is also what `tandem up --help` shows.
"""

from __future__ import annotations

import argparse

from tandem.services.common.flags import SERVICES, Flag, Owner, forwarded, owner_names, unique

# The flags each kind of child takes from `tandem up`.
WORKERS = Owner.ENGINE | Owner.WORKER


def _configs() -> dict[Owner, object]:
    from tandem.engine.config import EngineConfig
    from tandem.services.gateway.config import GatewayConfig
    from tandem.services.launcher.config import UpConfig
    from tandem.services.planner.config import PlannerConfig
    from tandem.services.router.config import RouterConfig
    from tandem.services.worker.config import WorkerConfig

    return {Owner.LAUNCHER: UpConfig(), Owner.ENGINE: EngineConfig(), Owner.WORKER: WorkerConfig(role=""),
            Owner.ROUTER: RouterConfig(), Owner.GATEWAY: GatewayConfig(), Owner.PLANNER: PlannerConfig()}


def up_flags() -> list[Flag]:
    """Every flag `tandem up` takes, in --help order: its own, then its children's."""
    from tandem.cli.engine_args import ENGINE_FLAGS
    from tandem.services.gateway.config import GATEWAY_FLAGS
    from tandem.services.launcher.config import LAUNCHER_FLAGS
    from tandem.services.planner.config import PLANNER_FLAGS
    from tandem.services.router.config import ROUTER_FLAGS
    from tandem.services.worker.config import WORKER_FLAGS

    flags = unique(LAUNCHER_FLAGS, ENGINE_FLAGS, WORKER_FLAGS, ROUTER_FLAGS, GATEWAY_FLAGS, PLANNER_FLAGS)
    return [f for f in flags if f.up_targets]


def _help_prefix(flag: Flag) -> str:
    """Who gets a flag that goes to some of the services only: "workers: ", "router and gateway: ", "planner: "
    (not said of the engine's flags, nor of those `tandem up` reads itself)."""
    to = flag.up_targets & (SERVICES | Owner.PLANNER)
    if flag.up_targets & (Owner.ENGINE | Owner.LAUNCHER) or not to or to & SERVICES == SERVICES:
        return ""
    return owner_names(to).replace("+", " and ") + ": "


def add_arguments(p: argparse.ArgumentParser) -> None:
    configs = _configs()
    for flag in up_flags():
        # The default a child would use: the first of the processes `tandem up` gives the flag to.
        flag.add_to(p, flag.default_in(configs, among=flag.up_targets), _help_prefix(flag))


def child_argv(args: argparse.Namespace, to: Owner) -> list[str]:
    """The flags of `args` (a parsed `tandem up` command line) that a child taking `to`'s flags gets."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return forwarded(args, parser, to)


def worker_args(args: argparse.Namespace) -> list[str]:
    return child_argv(args, WORKERS)


def router_args(args: argparse.Namespace) -> list[str]:
    return child_argv(args, Owner.ROUTER)


def gateway_args(args: argparse.Namespace) -> list[str]:
    return child_argv(args, Owner.GATEWAY)


def planner_args(args: argparse.Namespace) -> list[str]:
    return child_argv(args, Owner.PLANNER)


def router_args_up(args: argparse.Namespace) -> list[str]:
    """The router's; with --planner it serves with no prefill worker too, unless the user said otherwise
    (a shape may have none: the decode workers then prefill their own prompts)."""
    out = router_args(args)
    if args.planner and "--min-prefill-workers" not in out:
        out += ["--min-prefill-workers", "0"]
    return out


def up_config(args: argparse.Namespace):
    """The launcher's UpConfig from a parsed `tandem up` command line (not validated)."""
    from tandem.services.launcher.config import UpConfig

    return UpConfig(
        mode=args.mode, num_prefill=args.prefill, num_decode=args.decode, num_colocated=args.colocated,
        host=args.host, port=args.port, redis_url=args.redis_url, quiet=args.quiet, ready_json=args.ready_json,
        # Workers drain for up to their drain timeout on SIGTERM: only stragglers past it get SIGKILL.
        stop_grace_s=args.drain_timeout + 10.0, gateway_port=args.gateway_port, api_key=args.api_key,
        cpu_cores=args.cpu_cores, services_nice=args.services_nice, internal_token_file=args.internal_token_file, max_restarts=args.max_restarts,
        worker_args=tuple(worker_args(args)), router_args=tuple(router_args_up(args)),
        gateway_args=tuple(gateway_args(args)), planner=args.planner, planner_args=tuple(planner_args(args)),
    )


def run(args: argparse.Namespace) -> int:
    from tandem.cli.worker_cmd import fault_config
    from tandem.services.common.limits import RequestLimits
    from tandem.services.common.tls import tls_from_args
    from tandem.services.launcher.shaping import serves_without_prefill
    from tandem.services.launcher.up import run_up
    from tandem.services.worker.faults import FaultSpecError

    try:
        fault_config(args)  # refuse a bad or unauthorized --fault-inject before starting anything
    except FaultSpecError as e:
        print(f"error: {e}", flush=True)
        return 2

    try:
        RequestLimits.from_args(args)
        tls_from_args(args)
    except ValueError as e:
        print(f"error: {e}", flush=True)
        return 2
    cfg = up_config(args)
    if cfg.mode == "disagg" and (cfg.num_prefill < 0 or cfg.num_decode < 1):
        print("error: --decode must be >= 1 and --prefill >= 0", flush=True)
        return 2
    if cfg.mode == "disagg" and cfg.num_prefill == 0 and not serves_without_prefill(cfg.router_args):
        print("error: --prefill 0 needs a router that serves without prefill workers: add --min-prefill-workers 0 "
              "(or --planner)", flush=True)
        return 2
    if cfg.mode == "colocated" and cfg.num_colocated < 1:
        print("error: --colocated must be >= 1", flush=True)
        return 2
    if cfg.planner and cfg.mode != "disagg":
        print("error: --planner moves workers between the prefill and decode roles: it needs --mode disagg (a shape "
              "with no prefill worker serves like --colocated)", flush=True)
        return 2
    if cfg.max_restarts < 0:
        print("error: --max-restarts must be >= 0", flush=True)
        return 2
    if not 0 <= cfg.services_nice <= 19:
        print("error: --services-nice must be in [0, 19]", flush=True)
        return 2
    if not -1 <= cfg.gateway_port < 65536:
        print("error: --gateway-port must be in [-1, 65535]", flush=True)
        return 2
    return run_up(cfg)
