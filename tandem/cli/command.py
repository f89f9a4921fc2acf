"""What every `tandem` subcommand shares: the help formatter, `--log-level`, and running one
subcommand on its own parser (`python -m tandem.services.router ...` is `tandem router ...`). Torch-free:
the router's and the gateway's entry points import it."""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable

from tandem.services.common.shared_flags import LOG_LEVEL

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


def add_global_arguments(p: argparse.ArgumentParser) -> None:
    LOG_LEVEL.add_to(p, LOG_LEVEL.default)


def start(args: argparse.Namespace, run: Callable[[argparse.Namespace], int]) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


def standalone_parser(prog: str, summary: str,
                      add_arguments: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """One subcommand's parser as a program of its own, plus `--log-level`."""
    parser = argparse.ArgumentParser(prog=prog, description=summary, formatter_class=HelpFormatter)
    add_global_arguments(parser)
    add_arguments(parser)
    return parser

