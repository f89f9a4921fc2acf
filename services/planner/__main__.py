"""`python -m tandem.services.planner ...`: `tandem planner ...`, the same parser (its flags are declared once)."""

from __future__ import annotations

import argparse
import sys

from tandem.cli import planner_cmd
from tandem.cli.command import standalone_parser, start


def parser() -> argparse.ArgumentParser:
    return standalone_parser("python -m tandem.services.planner", planner_cmd.SUMMARY, planner_cmd.add_arguments)


def main(argv: list[str] | None = None) -> int:
    return start(parser().parse_args(argv), planner_cmd.run)


if __name__ == "__main__":
    sys.exit(main())
