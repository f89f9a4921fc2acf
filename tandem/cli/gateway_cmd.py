"""`tandem gateway`: the OpenAI-compatible HTTP gateway in front of the router."""

from __future__ import annotations

import argparse

SUMMARY = "run the OpenAI-compatible HTTP gateway in front of a router"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.services.gateway.config import add_arguments as add_gateway_arguments

    add_gateway_arguments(p)


def run(args: argparse.Namespace) -> int:
    # Imported here, not at module import: `tandem --help` stays instant.
    from tandem.services.common import tracing
    from tandem.services.gateway.server import run as run_gateway

    tracing.configure(args.otlp_traces_endpoint, "tandem-gateway")

    return run_gateway(args)
