"""`python -m tandem.bench.serve serve|sweep ...`: the same command as `tandem bench serve|sweep`."""

import argparse
import logging
import sys

from tandem.cli import bench_cmd

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.serve", description=bench_cmd.__doc__)
    parser.add_argument("--log-level", default="WARNING")
    bench_cmd.add_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(bench_cmd.run(args))
