"""Loaded into the vLLM peer's processes when the sweep runs under an ISA cap (an emulated older CPU).

`ONEDNN_MAX_CPU_ISA` / `ATEN_CPU_CAPABILITY` cap torch's and oneDNN's kernels, but vLLM picks its
own C++ kernels (`_C`, `_C_AVX512`, `_C_AVX2`) and some code paths by asking
`torch.cpu._is_avx512_supported()` and friends, which read CPUID and ignore the caps. On a real
AVX2-only machine those answer False; here they are made to answer what a CPU of the capped level
would (TANDEM_PEER_ISA: avx2 | avx512), so the peer runs the same kernels it would run there.
"""

import os

_LEVEL = os.environ.get("TANDEM_PEER_ISA", "")


def _torch_cpu():
    """torch.cpu, or None in an interpreter without torch: it cannot run vLLM, and an error here
    would print before (and read like) the peer's own failure."""
    try:
        import torch.cpu
    except ImportError:
        return None
    return torch.cpu


_CPU = _torch_cpu() if _LEVEL in ("generic", "avx2", "avx512") else None

if _CPU is not None:

    def _no() -> bool:
        return False

    _CPU._is_avx512_bf16_supported = _no
    _CPU._is_amx_tile_supported = _no
    _CPU._is_amx_fp16_supported = _no
    if _LEVEL != "avx512":
        _CPU._is_avx512_supported = _no
        _CPU._is_vnni_supported = _no
    if _LEVEL == "generic":
        _CPU._is_avx2_supported = _no
