"""The CPU linear kernel (kernels/cpu/linear.cpp) against an fp64 reference, on every ISA variant this
CPU can run: any row count (the row blocks and their remainders), output and input sizes that are not
multiples of the panel or of the vector width, more rows than one chunk of x (576 inputs: ~110 rows with
AVX2, ~220 with AVX-512), bias, strided rows, several threads; bad input refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

ROWS = [1, 2, 5, 8, 13, 32, 64, 257]


def _fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far any fp32 evaluation order (with or without FMAs) may land from the exact product:
    k * 2^-24 * (|x| . |w|ᵀ), per output element, plus one rounding of the bias add."""
    k = x.shape[1]
    return k * 2.0 ** -24 * F.linear(x.double().abs(), w.double().abs()) + 1e-30


def _check(ops, x, w, bias, weight_dtype=None):
    packed = ops.pack_linear(w, weight_dtype) if weight_dtype else ops.pack_linear(w)
    got = ops.linear(x, packed, bias, w.shape[0])
    assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == torch.float32 and got.is_contiguous()
    w_exact = w.to(weight_dtype).double() if weight_dtype else w.double()    # the weights the kernel holds
    want = F.linear(x.double(), w_exact, None if bias is None else bias.double())
    bound = _fp32_bound(x, w_exact.float()) + (0 if bias is None else want.abs() * 2.0 ** -24)
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst excess {(err - bound).max():.3g}"
    return got


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", [(100, 37), (53, 64), (96, 576), (7, 5), (1, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_fp64(ops, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = _check(ops, x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)   # and near MKL's fp32


@pytest.mark.parametrize("rows", [1, 8, 257])
def test_linear_takes_strided_rows(ops, rows):
    """Rows with a stride of their own (a slice of a wider tensor, as a split qkv would be)."""
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 200, generator=g)
    x = wide[:, 30:130]
    assert x.stride(0) == 200
    w, b = torch.randn(70, 100, generator=g), torch.randn(70, generator=g)
    torch.testing.assert_close(_check(ops, x, w, b), _check(ops, x.contiguous(), w, b), atol=0, rtol=0)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_linear_bf16_weights(ops, rows):
    """bf16 storage, fp32 compute: the product of x with the bf16-rounded weights, in fp32."""
    g = torch.Generator().manual_seed(rows)
    w, x, b = torch.randn(150, 96, generator=g), torch.randn(rows, 96, generator=g), torch.randn(150, generator=g)
    _check(ops, x, w, b, torch.bfloat16)


@pytest.mark.parametrize("n", [300, 40])
def test_linear_is_the_same_on_any_thread_count(ops, n):
    """Each output is one sum over k in order, whoever computes it: bit for bit the same on 1 and 3
    threads, for few rows (threads split the panels) and many (in chunks of rows; with few panels the
    threads split the rows too)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, 600, generator=g)
    packed = ops.pack_linear(w)
    threads = torch.get_num_threads()
    try:
        for rows in (3, 300):
            x = torch.randn(rows, 600, generator=g)
            outs = []
            for t in (1, 3):
                torch.set_num_threads(t)
                outs.append(ops.linear(x, packed, None, n))
            assert torch.equal(outs[0], outs[1])
            _check(ops, x, w, None)
    finally:
        torch.set_num_threads(threads)


def test_pack_linear_layout(ops):
    """[panels, k, panel]: column c of panel p is row p * panel + c of W; the last panel zero-padded."""
    panel = ops.LINEAR_PANEL
    w = torch.randn(panel + 3, 10)
    packed = ops.pack_linear(w)
    assert packed.shape == (2, 10, panel) and packed.dtype == torch.float32
    assert torch.equal(packed[1, :, 2], w[panel + 2]) and torch.equal(packed[0, :, 0], w[0])
    assert not packed[1, :, 3:].any()
    assert ops.pack_linear(w, torch.bfloat16).dtype == torch.bfloat16
    assert ops.linear(torch.randn(0, 10), packed, None, panel + 3).shape == (0, panel + 3)


def test_linear_refuses_bad_input(ops):
    panel = ops.LINEAR_PANEL
    w = torch.randn(panel + 3, 16)
    packed = ops.pack_linear(w)
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear(x.double(), packed, None, panel + 3)
    with pytest.raises(RuntimeError, match="unit stride"):
        ops.linear(torch.randn(16, 4).t(), packed, None, panel + 3)
    with pytest.raises(RuntimeError, match="input features"):
        ops.linear(torch.randn(4, 15), packed, None, panel + 3)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.linear(x, packed, None, panel)                       # the second panel would be empty
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.linear(x, packed, None, 2 * panel + 1)
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.linear(x, w, None, panel + 3)                        # not packed
    with pytest.raises(RuntimeError, match="packed must be"):
        ops.linear(x, packed.transpose(1, 2).contiguous().transpose(1, 2), None, panel + 3)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear(x, packed, torch.randn(panel + 2), panel + 3)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear(x, packed, torch.randn(panel + 3).double(), panel + 3)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.pack_linear(w, torch.float16)
    with pytest.raises(RuntimeError, match="weight"):
        ops.pack_linear(torch.randn(3, 4, 5))
