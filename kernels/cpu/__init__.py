"""Fused C++ kernels for the CPU path: paged decode attention, RMSNorm (+ residual), RoPE, and
bf16 prefill/extend attention.

Why: a decode step of a small model on a CPU core is mostly many small ops. Profiled at the serving
shape (12 sequences x 300 keys, one core, bf16, prepacked weights), the torch attention spent
~1.6 ms per step gathering pages into a copy and ~10 ms in the two batched matmuls that then read
that copy (plus a transposed copy of V), and norms + RoPE were ~25 small ops per layer, each a few
microseconds of dispatch. `paged_decode_attention` reads every key and value once, straight from
its page (no gather, no padding, fp32 softmax); `rms_norm` and `rope_` do in one call what took
8-10 ops. vLLM's CPU backend has kernels of the same kind; these are our own.

Numerics: fp32 arithmetic throughout, rounding to the model dtype where the torch code rounds. RoPE
and the norm's element-wise part are bit-identical to the torch code (`-ffp-contract=off`: no fused
multiply-adds); the norm's sum of squares and attention's dot products sum in another order, and the
attention keeps its scores and probabilities in fp32 where the torch path rounded them to bf16.

`paged_extend_attention` (extend.cpp) is the exception that is not fp32 arithmetic throughout: built
only where the compiler targets AVX512-BF16, it multiplies bf16 pairs with `vdpbf16ps` (fp32 sums),
~2x the rate of fp32 FMAs, and splits each probability into two bf16 parts (~16 significant bits)
for the P.V products. torch's fp32 causal SDPA was half of a 2,048-token prefill on one core (77 ms
per layer); torch's bf16 SDPA and MKL's bf16 GEMM convert to fp32 on this CPU and are no faster.

Build: compiled on first use with `torch.utils.cpp_extension` (ninja, the system C++ compiler) for
this CPU (`-march=native`), cached under `$TANDEM_CACHE_DIR/cpu_ops` (default `~/.cache/tandem`),
keyed by the source, the flags, the torch version and the CPU's feature flags; `make install`
builds it once (`python -m kernels.cpu`). `load()` returns None, logging why, where it cannot be
built: the engine then runs the torch code (engine/attention/torch_backend.py, engine/models/).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / "ops.cpp", HERE / "attention.cpp", HERE / "extend.cpp"]
HEADERS = [HERE / "common.h"]
# -fopenmp: at::parallel_for is inline OpenMP, so without it every kernel runs on one thread. The
# libgomp.so.1 it links is the one torch ships and has already loaded (same soname), not a second runtime.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return Path(root) / "cpu_ops"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_key() -> str:
    import torch

    digest = hashlib.sha256()
    parts = [p.read_bytes() for p in SOURCES + HEADERS]
    for part in (*parts, " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(), _cpu_flags().encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled module (built on first call, then cached on disk and in this process), or None
    where it cannot be built here (the reason is logged once)."""
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _build(verbose)
        return _state["ops"]


def _build(verbose: bool) -> ModuleType | None:
    try:
        from torch.utils import cpp_extension

        key = build_key()
        build_dir = cache_dir() / key
        build_dir.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(name=f"tandem_cpu_ops_{key}", sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                                  extra_ldflags=LDFLAGS, build_directory=str(build_dir),
                                  extra_include_paths=[str(HERE)], verbose=verbose)
    except Exception as exc:   # no compiler, no ninja, a read-only cache: the torch code still runs
        log.warning("CPU kernels unavailable, using the torch code instead: %s", str(exc).strip()[-500:])
        return None
