"""Fused RMSNorm (+residual) against engine.models.layers.RMSNorm, the module it replaces on GPU."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.models.layers import RMSNorm
from tandem.kernels import reference
from tandem.kernels.rmsnorm import rms_norm
from tests.kernels.helpers import DEVICE, DTYPES, assert_close, randn


def make_norm(dim: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=gen))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [48, 64])
def test_matches_module(dtype, dim):
    gen = torch.Generator().manual_seed(0)
    norm = make_norm(dim, dtype, gen)
    x = randn(5, dim, dtype=dtype, gen=gen) * 3
    residual = randn(5, dim, dtype=dtype, gen=gen)
    assert_close(rms_norm(x, norm.weight, norm.eps), norm(x), dtype)
    y, new_residual = rms_norm(x, norm.weight, norm.eps, residual)
    y_ref, res_ref = norm.add_forward(x, residual)
    assert_close(y, y_ref, dtype)
    assert_close(new_residual, res_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_residual_stream(dtype):
    # The decoders keep the residual in fp32 and feed the norm's output to bf16/fp16 matmuls.
    gen = torch.Generator().manual_seed(2)
    norm = make_norm(64, dtype, gen)
    x = randn(5, 64, dtype=dtype, gen=gen) * 3
    residual = randn(5, 64, dtype=torch.float32, gen=gen)
    y, new_residual = rms_norm(x, norm.weight, norm.eps, residual)
    y_ref, res_ref = norm.add_forward(x, residual)
    assert y.dtype == dtype and new_residual.dtype == torch.float32
    assert_close(y, y_ref, dtype)
    assert_close(new_residual, res_ref, torch.float32)


def test_strided_3d_input_as_qk_norm():
    # Qwen3's q_norm: [T, H, D] heads of a strided slice of the fused qkv projection.
    gen = torch.Generator().manual_seed(1)
    fused = randn(3, 4 * 16 + 8, dtype=torch.float32, gen=gen)
    q = fused[:, :64].view(3, 4, 16)
    weight = randn(16, dtype=torch.float32, gen=gen)
    assert_close(rms_norm(q, weight, 1e-5), reference.rms_norm(q, weight, 1e-5), torch.float32)


def test_argument_checks():
    with pytest.raises(ValueError, match="weight's size"):
        rms_norm(torch.ones(2, 8, device=DEVICE), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.ones(2, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6,
                 torch.ones(3, 8, device=DEVICE))
