"""Helpers shared by the kernel wrappers: argument checks and launch-parameter choices."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check(cond: bool, msg: str) -> None:
    """Caller errors (bad shapes/dtypes/strides) raise ValueError; they are never asserts."""
    if not cond:
        raise ValueError(msg)


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes=SUPPORTED_DTYPES,
                 device: torch.device | None = None, unit_last_stride: bool = True) -> None:
    check(isinstance(t, torch.Tensor), f"{name} must be a tensor")
    check(t.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    check(t.dtype in dtypes, f"{name} dtype {t.dtype} not in {[str(d) for d in dtypes]}")
    if device is not None:
        check(t.device == device, f"{name} is on {t.device}, expected {device}")
    if unit_last_stride and t.shape[-1] > 1:
        check(t.stride(-1) == 1, f"{name} must have a unit stride on its last dim, got {t.stride()}")


def upcast(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a kernel converts loaded tiles to fp32 before `tl.dot`.

    fp32 storage always computes in fp32 (IEEE dots, no TF32). Half-precision tiles go to tensor
    cores as they are on a GPU; on CPU (the interpreter) bf16 is converted first because the
    interpreter's bf16 arithmetic is wrong (it holds bf16 as uint16).
    """
    return dtype == torch.float32 or (dtype == torch.bfloat16 and device.type != "cuda")


def attention_tile(block_d: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows (keys, or query x head rows) per attention tile: 64 at head_dim 128 in fp16/bf16.

    Halved for fp32 on a GPU (its dots run on CUDA cores and hold more in registers) and for wider
    heads, which keeps the kernels free of register spills on sm_90 (tests/kernels/sm90_compile.py).
    """
    budget = 4096 if device.type == "cuda" and dtype == torch.float32 else 8192
    return max(16, min(64, budget // block_d))


def num_warps_for(block_elems: int) -> int:
    return 4 if block_elems < 4096 else 8


def is_interpreted(kernel) -> bool:
    """Whether a `@triton.jit` kernel was built for the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
