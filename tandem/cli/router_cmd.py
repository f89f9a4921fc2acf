"""`tandem router`: the public gRPC entry point that pairs prefill and decode workers."""

from __future__ import annotations

import argparse

SUMMARY = "run the router: the public gRPC API, pairing prefill and decode workers"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.services.router.config import add_arguments as add_router_arguments

    add_router_arguments(p)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at module import: `tandem --help` stays instant.
    from tandem.services.common import tracing
    from tandem.services.router.server import run as run_router

    tracing.configure(args.otlp_traces_endpoint, "tandem-router")

    return run_router(args)
