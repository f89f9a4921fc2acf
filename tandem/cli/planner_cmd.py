"""`tandem planner`: the SLO planner, which sizes prefill and decode capacity to the load (docs/planner.md)."""

from __future__ import annotations

import argparse

SUMMARY = "run the SLO planner: reshape prefill/decode capacity to keep the TTFT and ITL targets"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.services.planner.config import add_arguments as add_planner_arguments

    add_planner_arguments(p)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at module import: `tandem --help` stays instant.
    from tandem.services.planner.server import run as run_planner

    return run_planner(args)
