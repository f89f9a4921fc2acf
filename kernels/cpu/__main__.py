"""`python -m tandem.kernels.cpu [-v]`: build (or find in the cache) the CPU kernels of every ISA level this
CPU can run, and import each; exit 1 if one cannot be built (the engine would then run the torch code)."""

import logging
import sys
import time

from tandem.kernels.cpu import build, cache_dir, load, runnable_levels
from tandem.kernels.cpu.isa import effective_level

logging.basicConfig(level=logging.WARNING, format="%(message)s")
t0 = time.perf_counter()
try:
    build(runnable_levels(), verbose="-v" in sys.argv)
except Exception as exc:
    sys.exit(f"CPU kernels could not be built ({exc}); the engine will run the torch code")
if any(load(level) is None for level in runnable_levels()):
    sys.exit("CPU kernels could not be loaded (see the warning above); the engine will run the torch code")
print(f"CPU kernels ready in {time.perf_counter() - t0:.1f} s: {', '.join(runnable_levels())} "
      f"(this process would load {effective_level()}) in {cache_dir()}")
