"""`tandem` command line: one subcommand per role (`generate` now; services register theirs here)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from tandem import bench_cmd, gateway_cmd, generate_cmd, router_cmd, up_cmd, worker_cmd

# name -> (add_arguments, run); each subcommand lives in its own module.
SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "generate": (generate_cmd.add_arguments, generate_cmd.run),
    "prefill": (worker_cmd.add_arguments, worker_cmd.run_prefill),
    "decode": (worker_cmd.add_arguments, worker_cmd.run_decode),
    "colocated": (worker_cmd.add_arguments, worker_cmd.run_colocated),
    "router": (router_cmd.add_arguments, router_cmd.run),
    "gateway": (gateway_cmd.add_arguments, gateway_cmd.run),
    "bench": (bench_cmd.add_arguments, bench_cmd.run),
    "up": (up_cmd.add_arguments, up_cmd.run),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _) in SUBCOMMANDS.items():
        add_args(sub.add_parser(name))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return SUBCOMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
