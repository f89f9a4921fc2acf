"""`tandem` command line: one subcommand per role; each lives in its own module."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable

from tandem import bench_cmd, gateway_cmd, generate_cmd, router_cmd, up_cmd, worker_cmd

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
    "router": ("run the router: the public gRPC API, pairing prefill and decode workers",
               router_cmd.add_arguments, router_cmd.run),
    "gateway": ("run the OpenAI-compatible HTTP gateway in front of a router",
                gateway_cmd.add_arguments, gateway_cmd.run),
    "bench": ("load-test an endpoint (serve) or compare deployments across request rates (sweep)",
              bench_cmd.add_arguments, bench_cmd.run),
}


_SAYS_DEFAULT = re.compile(r"\bdefault:", re.IGNORECASE)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, once. Not added where the help already says it
    ("default: ..." in the text: a default decided at start, or a flag that a plain argparse parser
    shows too), where there is none to show (None, an empty value), nor to on/off switches:
    "(default: True)" reads backwards on `--disable-X`, so a switch's help says what happens unless
    it is given."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default is None or action.default is False or action.default in ("", [])
                or action.nargs == 0 or _SAYS_DEFAULT.search(text)):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--log-level", default="WARNING",
                        help="Python logging level of this process: DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, add_args, _) in SUBCOMMANDS.items():
        add_args(sub.add_parser(name, help=summary, description=summary, formatter_class=HelpFormatter))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return SUBCOMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())
