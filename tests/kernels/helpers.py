"""Shared by the kernel tests: the device they run on, tolerances per dtype, random inputs."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# fp32: kernel and reference differ only in summation order. fp16/bf16: one rounding of the output
# (the interpreter truncates fp32 -> bf16 instead of rounding: up to 1 bf16 ulp, 2**-7 relative),
# plus, on a GPU, the fp16/bf16 softmax weights fed to the tensor cores.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOL[dtype])


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def page_table(batch: int, pages_each: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """Each sequence gets distinct pages in a random order (so neighbours are never adjacent)."""
    perm = torch.randperm(num_pages, generator=gen)
    assert batch * pages_each <= num_pages
    return perm[: batch * pages_each].view(batch, pages_each).to(torch.int32).to(DEVICE)
