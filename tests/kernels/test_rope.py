"""Fused RoPE against engine.models.rope.RotaryEmbedding (the torch path it replaces on GPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.models.config import RopeConfig
from tandem.engine.models.rope import RotaryEmbedding
from tandem.kernels.rope import apply_rope
from tests.kernels.helpers import DEVICE, DTYPES, assert_close, randn


def make_qk(dtype, tokens, heads, kv_heads, head_dim, gen):
    # q and k are strided slices of a fused qkv projection, as in the model.
    fused = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, gen=gen)
    q = fused[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = fused[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return q, k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 24)])
def test_matches_rotary_embedding(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 64).to(DEVICE)
    q, k = make_qk(dtype, 5, heads, kv_heads, head_dim, gen)
    positions = torch.tensor([0, 1, 7, 30, 63], device=DEVICE)
    cos, sin = rope.lookup(positions)
    q_ref, k_ref = RotaryEmbedding.apply((cos, sin), q, k)
    q_out, k_out = apply_rope(q, k, cos.squeeze(1), sin.squeeze(1))
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)
    apply_rope(q, k, cos.squeeze(1), sin.squeeze(1), inplace=True)
    assert torch.equal(q, q_out) and torch.equal(k, k_out)


def test_argument_checks():
    q = torch.ones(2, 2, 8, device=DEVICE)
    cos = torch.ones(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rope(q, q, cos[:, :3], cos[:, :3])
    with pytest.raises(ValueError, match="even"):
        apply_rope(q[..., :7], q[..., :7], cos, cos)
