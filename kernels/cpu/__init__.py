"""Fused C++ kernels for the CPU path: paged decode attention, paged prefill/extend attention,
RMSNorm (+ residual), RoPE, the fp32 linear and mixed-adapter LoRA, one source per operation,
compiled once per ISA level.

Why: a decode step of a small model on a CPU core is mostly many small ops. Profiled at the serving
shape (12 sequences x 300 keys, one core, bf16, prepacked weights), the torch attention spent
~1.6 ms per step gathering pages into a copy and ~10 ms in the two batched matmuls that then read
that copy (plus a transposed copy of V), and norms + RoPE were ~25 small ops per layer, each a few
microseconds of dispatch. `paged_decode_attention` reads every key and value once, straight from
its page (no gather, no padding, fp32 softmax); `rms_norm` and `rope_` do in one call what took
8-10 ops. `paged_extend_attention` is the prefill/extend counterpart: causal, straight from the
sequence's pages (SDPA needs a gather and an explicit mask once a prefix is cached), an online
softmax, fp32 compute. `linear` is the fp32 projection on weights packed once into panels
(`pack_linear`): at decode's 1-64 rows MKL's and oneDNN's fp32 GEMMs use a third to a half of the
core, and the projections are ~95% of an fp32 decode step (engine/models/prepack.py).
`lora_` (lora.cpp) adds a step's LoRA adapters into a projection's output (engine/lora/batch.py):
each row by its own adapter's columns of the stacked A and Bᵀ only (the torch paths multiplied every
row by every loaded adapter, or gathered rows per adapter, in bf16 matmuls that oneDNN reorders per
call), each part of a fused q/k/v or gate/up block into its own outputs only.
vLLM's CPU backend has kernels of the same kind; these are our own.

Numerics: fp32 arithmetic throughout, rounding to the model dtype where the torch code rounds. RoPE
and the norm's element-wise part are bit-identical to the torch code (ops.cpp is compiled with
`-ffp-contract=off`: no fused multiply-adds); the norm's sum of squares and attention's dot products
sum in another order, and attention keeps its scores and probabilities in fp32; `linear` sums each
output over k in order (not MKL's order), deterministic for any thread count; `lora_` sums in fp32
and rounds `x · A` to the dtype and the output once, where the torch code `y.addmm_(x @ a.t(), b.t())`
rounds, deterministic for any thread count too (in bf16 the `avx512_bf16` variant multiplies its
bf16 operands in pairs with `vdpbf16ps`: exact products, fp32 sums). The one exception is bf16
extend attention in the `avx512_bf16` variant, which multiplies bf16 pairs with `vdpbf16ps` (fp32
sums, ~2x the rate of fp32 FMAs) and splits each probability into two bf16 parts (~16 significant
bits) for the P.V products (extend.cpp).

Variants: one per ISA level of `kernels.cpu.isa` (`generic` < `avx2` < `avx512` < `avx512_bf16`),
each the same sources compiled with that level's flags (`LEVEL_FLAGS`; the differences inside the
sources are `#if`s on the compiler's feature macros: vector width and tile sizes, the `vdpbf16ps`
kernels). The variant loaded is `isa.effective_level()`: the host's best, capped the way torch and
oneDNN are capped (`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`), so that an AVX-512 machine
emulating an AVX2-only one runs the avx2 kernels too. The loaded module says which (`LEVEL`) and
what its extend kernel takes (`extend_attention_supported(dtype, head_dim)`).

Build: the kernel sources are plain C++ (no torch headers: seconds per variant); one small binding
(binding.cpp: torch's argument checks and pybind11, the slow one to compile) is compiled once and
linked with each variant's kernel objects into that variant's Python module. Both are cached under
`$TANDEM_CACHE_DIR/cpu_ops` (default `~/.cache/tandem`) by content (build.py: keyed by sources,
flags, compiler, torch and Python versions and level, not by the checkout's path; a file lock so
that one process builds and the others wait; published atomically, so a killed build leaves nothing
behind that a later one trusts). A worker that must compile says so in its log, with the time.
`make install` builds every level this CPU can run (`python -m tandem.kernels.cpu`). `load()` returns None,
logging why, where the kernels cannot be built: the engine then runs the torch code
(engine/attention/torch_backend.py, engine/models/).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tandem.kernels.cpu import isa
from tandem.kernels.cpu.build import Artifact, BuildError, cached, compiler_id, digest, entry_dir, run

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
MODULE = "tandem_cpu_ops"
# Kernel sources with their own flags: RoPE and the norm must not fuse multiply-adds (bit-identical to
# the torch code); attention may.
KERNELS = {"ops.cpp": ["-ffp-contract=off"], "attention.cpp": ["-ffp-contract=fast"],
           "extend.cpp": ["-ffp-contract=fast"], "linear.cpp": ["-ffp-contract=fast"],
           "lora.cpp": ["-ffp-contract=fast"]}
HEADERS = ["kernels.h", "common.h"]
BINDING = "binding.cpp"
# -fopenmp: the kernels run OpenMP teams; the libgomp.so.1 they link is the one torch ships and has
# already loaded (same soname), not a second runtime.
KERNEL_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-Wno-psabi"]
LEVEL_FLAGS = {
    "generic": ["-march=x86-64", "-mtune=generic"],     # elsewhere than x86: the compiler's default target
    "avx2": ["-march=x86-64-v3"],                       # AVX2, FMA, F16C (Haswell, Zen 1)
    "avx512": ["-march=x86-64-v4"],                     # + AVX-512 F/BW/CD/DQ/VL (Skylake-SP)
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16"],
}
BINDING_FLAGS = ["-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden", f"-DTORCH_EXTENSION_NAME={MODULE}",
                 "-DTORCH_API_INCLUDE_EXTENSION_H", "-w"]
# Cold build times on a 2-core Zen 4 (the first log line quotes their sum): the binding (torch
# headers) and one variant's kernel sources, compiled in parallel.
BINDING_S, VARIANT_S = 25.0, 4.0

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}


@dataclass(frozen=True)
class _Env:
    cache: Path      # $TANDEM_CACHE_DIR/cpu_ops
    cxx: str         # $CXX, else c++


def _env() -> _Env:
    """The environment the build reads (the ISA caps are read in isa.py)."""
    root = os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")
    return _Env(Path(root) / "cpu_ops", os.environ.get("CXX") or "c++")


def cache_dir() -> Path:
    return _env().cache


def runnable_levels() -> tuple[str, ...]:
    """The variants this CPU can run, lowest first (what `make install` builds)."""
    return isa.levels_up_to(isa.host_level())


def load(level: str | None = None, verbose: bool = False) -> ModuleType | None:
    """The kernels' module for `level` (default `isa.effective_level()`), built on first use and then
    cached on disk and in this process; None where it cannot be built here (the reason is logged
    once). The module has `LEVEL`, `extend_attention_supported(dtype, head_dim)` and the kernels."""
    level = level or isa.effective_level()
    with _lock:
        if level not in _modules:
            try:
                _modules[level] = _import(level, build([level], verbose)[level])
            except Exception as exc:   # no compiler, a read-only cache, a failed build: the torch code runs
                log.warning("CPU kernels (%s) unavailable, using the torch code instead: %s", level,
                            str(exc).strip()[-1500:])
                _modules[level] = None
        return _modules[level]


def build(levels: list[str] | tuple[str, ...], verbose: bool = False) -> dict[str, Path]:
    """Builds (or finds in the cache) the modules of `levels`; their paths. Raises what went wrong."""
    for level in levels:
        if level not in runnable_levels():
            raise ValueError(f"this CPU cannot run the {level} kernels (it runs {', '.join(runnable_levels())})")
    env = _env()
    cid = compiler_id(env.cxx)
    binding = _binding(env, cid, verbose)
    return {level: cached(env.cache, _variant(env, cid, level, binding, verbose)) for level in levels}


def _import(level: str, path: Path) -> ModuleType:
    import torch  # noqa: F401  (the module links libtorch: load it first)

    # Each variant under a name of its own (pybind11 caches modules by name; the init function looked
    # up is the last part's, PyInit_tandem_cpu_ops), not entered in sys.modules: tests load several.
    name = f"tandem.kernels.cpu.{level}.{MODULE}"
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _sources(names: list[str]) -> list[bytes]:
    return [part for name in names for part in (name.encode(), (HERE / name).read_bytes())]


def _copy(names: list[str], into: Path) -> None:
    for name in names:
        shutil.copyfile(HERE / name, into / name)


def _binding(env: _Env, cid: str, verbose: bool) -> Artifact:
    import torch

    torch_dir = Path(torch.__file__).parent
    includes = [torch_dir / "include", torch_dir / "include" / "torch" / "csrc" / "api" / "include",
                Path(sysconfig.get_paths()["include"])]
    key = digest([*_sources([BINDING, "kernels.h"]), *BINDING_FLAGS, cid, torch.__version__, sys.version,
                  sysconfig.get_config_var("EXT_SUFFIX") or ""])

    def compile_binding(tmp: Path) -> None:
        _copy([BINDING, "kernels.h"], tmp)
        flags = [f for inc in includes for f in ("-isystem", str(inc))]
        run([env.cxx, *BINDING_FLAGS, *flags, "-c", BINDING, "-o", "binding.o"], tmp, verbose)

    return Artifact("binding", key, "binding.o", compile_binding, "the torch binding of Tandem's CPU kernels",
                    BINDING_S, announce=False)


def _variant(env: _Env, cid: str, level: str, binding: Artifact, verbose: bool) -> Artifact:
    import torch

    level_flags = LEVEL_FLAGS[level] if isa.is_x86() else []
    flags = [*KERNEL_FLAGS, *level_flags, f'-DTANDEM_CPU_LEVEL="{level}"']
    key = digest([*_sources([*KERNELS, *HEADERS]), *flags, *(f for fs in KERNELS.values() for f in fs), level,
                  binding.key, cid, platform.machine()])
    binding_ready = (entry_dir(env.cache, binding) / "ready").exists()

    def compile_variant(tmp: Path) -> None:
        _copy([*KERNELS, *HEADERS], tmp)
        with ThreadPoolExecutor(max_workers=len(KERNELS) + 1) as pool:   # the compiler runs in subprocesses
            binding_o = pool.submit(cached, env.cache, binding)
            objects = [pool.submit(run, [env.cxx, *flags, *extra, "-c", src, "-o", src.replace(".cpp", ".o")],
                                   tmp, verbose) for src, extra in KERNELS.items()]
            for job in objects:
                job.result()
            obj = binding_o.result()
        lib = Path(torch.__file__).parent / "lib"
        run([env.cxx, "-shared", "-fopenmp", str(obj), *(s.replace(".cpp", ".o") for s in KERNELS), f"-L{lib}",
             "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python", "-o", f"{MODULE}.so"], tmp, verbose)

    estimate = VARIANT_S + (0.0 if binding_ready else BINDING_S)
    return Artifact(level, key, f"{MODULE}.so", compile_variant, f"Tandem's CPU kernels ({level})", estimate)


__all__ = ["BuildError", "build", "cache_dir", "load", "runnable_levels"]
