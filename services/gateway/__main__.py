"""`python -m services.gateway ...`: the same as `tandem gateway ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from services.gateway.config import add_arguments
from services.gateway.server import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description="Tandem OpenAI-compatible gateway")
    parser.add_argument("--log-level", default="WARNING")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
