"""`python -m services.router ...`: the same as `tandem router ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from services.router.config import add_arguments
from services.router.server import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.router", description="Tandem router")
    parser.add_argument("--log-level", default="INFO")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
