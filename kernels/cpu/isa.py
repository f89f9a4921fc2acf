"""What instruction set this CPU offers to Tandem's kernels, torch-free.

One ordered scale of x86 levels, each a superset of the one before:

| level         | what it needs (/proc/cpuinfo flags)             | typical CPUs                       |
|---------------|-------------------------------------------------|------------------------------------|
| `generic`     | nothing (any CPU; non-x86 machines stop here)   | ARM, pre-Haswell x86               |
| `avx2`        | avx2, fma, f16c                                 | Haswell..Ice Lake client, Zen 1-3  |
| `avx512`      | avx512f, avx512bw, avx512vl, avx512dq           | Skylake-SP, Cascade Lake           |
| `avx512_bf16` | avx512 + avx512_bf16 (native bf16 dot products) | Cooper/Sapphire Rapids, Zen 4+     |

`host_level()` reads the CPU; `effective_level()` caps it the way torch and oneDNN are capped, by
`ATEN_CPU_CAPABILITY` (default / avx2 / avx512) and `ONEDNN_MAX_CPU_ISA` (SSE41, AVX, AVX2,
AVX2_VNNI, AVX512_CORE, AVX512_CORE_VNNI, AVX512_CORE_BF16, AVX512_CORE_AMX, ...), so that
`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` makes an AVX-512 machine behave as an AVX2-only
one everywhere: torch's kernels, oneDNN's, and ours (the kernel variant chosen is the effective
level's). The environment is read here and nowhere else in the kernels.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from pathlib import Path

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")

_REQUIRES = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"},
}

# ATEN_CPU_CAPABILITY's values (torch/aten CPU dispatch) -> the highest level they allow.
_ATEN_CAP = {"default": "generic", "avx2": "avx2", "avx512": "avx512_bf16"}
# ONEDNN_MAX_CPU_ISA's values -> the highest level they allow (ALL: no cap).
_ONEDNN_CAP = {
    "sse41": "generic", "avx": "generic", "avx2": "avx2", "avx2_vnni": "avx2", "avx2_vnni_2": "avx2",
    "avx512_core": "avx512", "avx512_core_vnni": "avx512", "avx512_core_bf16": "avx512_bf16",
    "avx10_1_512": "avx512_bf16", "avx512_core_fp16": "avx512_bf16", "avx512_core_amx": "avx512_bf16",
    "avx10_1_512_amx": "avx512_bf16", "avx512_core_amx_fp16": "avx512_bf16",
    "avx10_1_512_amx_fp16": "avx512_bf16", "avx10_2_512": "avx512_bf16", "avx10_2_512_amx_2": "avx512_bf16",
    "all": "avx512_bf16",
}


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, ARM `Features`) from /proc/cpuinfo; empty if unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64", "i686", "i386")


def host_level(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The highest level this CPU supports (what it could run, before any cap)."""
    if not is_x86(machine):
        return "generic"
    flags = cpu_flags() if flags is None else flags
    best = "generic"
    for level in LEVELS[1:]:
        if _REQUIRES[level] <= flags:
            best = level
    return best


def caps(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The caps in force: {variable: the level it allows}; unknown values are ignored (as torch does)."""
    env = os.environ if environ is None else environ
    out = {}
    aten = env.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in _ATEN_CAP:
        out["ATEN_CPU_CAPABILITY"] = _ATEN_CAP[aten]
    onednn = _onednn_max_isa(env)
    if onednn in _ONEDNN_CAP:
        out["ONEDNN_MAX_CPU_ISA"] = _ONEDNN_CAP[onednn]
    return out


def lower(a: str, b: str) -> str:
    return a if LEVELS.index(a) <= LEVELS.index(b) else b


def effective_level(environ: Mapping[str, str] | None = None, flags: frozenset[str] | None = None,
                    machine: str | None = None) -> str:
    """The host's level capped by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA (an emulated older CPU)."""
    level = host_level(flags, machine)
    for cap in caps(environ).values():
        level = lower(level, cap)
    return level


_AMX_FLAGS = {"amx_tile", "amx_bf16"}


def amx(environ: Mapping[str, str] | None = None, flags: frozenset[str] | None = None,
        machine: str | None = None) -> bool:
    """Whether oneDNN multiplies bf16 on AMX tiles here (Sapphire Rapids and later Xeons): the CPU has
    AMX-BF16, its level is not capped below avx512_bf16, and ONEDNN_MAX_CPU_ISA (if set) names an AMX
    level or ALL. Torch's own kernels are not AMX-specific, so ATEN_CPU_CAPABILITY matters only
    through the level."""
    flags = cpu_flags() if flags is None else flags
    if not is_x86(machine) or not _AMX_FLAGS <= flags or effective_level(environ, flags, machine) != "avx512_bf16":
        return False
    onednn = _onednn_max_isa(os.environ if environ is None else environ)
    return onednn in ("", "all") or "amx" in onednn


def _onednn_max_isa(env: Mapping[str, str]) -> str:
    """oneDNN's ISA cap as it reads it (ONEDNN_MAX_CPU_ISA, or the older DNNL_ name), lower case; "" unset."""
    return env.get("ONEDNN_MAX_CPU_ISA", env.get("DNNL_MAX_CPU_ISA", "")).strip().lower()


def levels_up_to(level: str) -> tuple[str, ...]:
    """Every level a CPU of `level` can run, lowest first."""
    return LEVELS[: LEVELS.index(level) + 1]
