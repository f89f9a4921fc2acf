"""`tandem` command line: one subcommand per role; each lives in its own module."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from tandem.cli import (
    bench_cmd,
    gateway_cmd,
    generate_cmd,
    planner_cmd,
    reshape_cmd,
    router_cmd,
    trace_cmd,
    up_cmd,
    worker_cmd,
)
from tandem.cli.command import HelpFormatter, add_global_arguments, start

# name -> (one-line description, add_arguments, run); each subcommand lives in its own module.
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "up": ("run the whole stack on this machine: Redis, workers, router and HTTP gateway",
           up_cmd.add_arguments, up_cmd.run),
    "generate": ("generate offline with the co-located engine (no services), streamed to stdout",
                 generate_cmd.add_arguments, generate_cmd.run),
    "prefill": ("run one prefill worker: computes prompts' KV and pushes it to a decode worker",
                worker_cmd.add_arguments, worker_cmd.run_prefill),
    "decode": ("run one decode worker: receives prompts' KV and streams the generated tokens",
               worker_cmd.add_arguments, worker_cmd.run_decode),
    "colocated": ("run one co-located worker: prefill and decode in one process, no KV transfer",
                  worker_cmd.add_arguments, worker_cmd.run_colocated),
    "router": (router_cmd.SUMMARY, router_cmd.add_arguments, router_cmd.run),
    "gateway": (gateway_cmd.SUMMARY, gateway_cmd.add_arguments, gateway_cmd.run),
    "bench": ("load-test an endpoint (serve) or compare deployments across request rates (sweep)",
              bench_cmd.add_arguments, bench_cmd.run),
    "trace": (trace_cmd.SUMMARY, trace_cmd.add_arguments, trace_cmd.run),
    "reshape": (reshape_cmd.SUMMARY, reshape_cmd.add_arguments, reshape_cmd.run),
    "planner": (planner_cmd.SUMMARY, planner_cmd.add_arguments, planner_cmd.run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving",
                                     formatter_class=HelpFormatter)
    add_global_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, add_args, _) in SUBCOMMANDS.items():
        add_args(sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return start(args, SUBCOMMANDS[args.command][2])

