"""Tandem's load-test harness and benchmarks (`python -m tandem.bench.<name>`, `tandem bench`)."""

import sys
from pathlib import Path

# `python -m tandem.bench.X` run from the checkout puts the checkout first on sys.path, where its
# kernels/ folder would shadow Hugging Face's `kernels` (transformers imports it). While `-m` is still
# importing this package, take the checkout off again: Tandem's own modules come through `tandem`.
if sys.argv[:1] == ["-m"]:
    _root = Path(__file__).resolve().parent.parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _root]
