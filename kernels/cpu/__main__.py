"""`python -m kernels.cpu`: build (or find in the cache) the CPU kernels; exit 1 if they cannot be built."""

import sys
import time

from kernels.cpu import cache_dir, load

t0 = time.perf_counter()
ops = load(verbose="-v" in sys.argv)
if ops is None:
    sys.exit("CPU kernels could not be built (see the warning above); the engine will run the torch code")
print(f"CPU kernels ready in {time.perf_counter() - t0:.1f} s ({cache_dir()})")
