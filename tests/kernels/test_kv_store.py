"""KV store writes exactly the given slots (bit-exact for every dtype) and skips negative ones."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import reference
from tandem.kernels.kv_store import store_kv
from tests.kernels.helpers import DEVICE, DTYPES, randn


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [1, 4])
def test_matches_reference(dtype, page_size):
    gen = torch.Generator().manual_seed(0)
    kv_heads, head_dim, num_pages, tokens = 3, 20, 9, 7
    k_cache = randn(num_pages, page_size, kv_heads, head_dim, dtype=dtype, gen=gen)
    v_cache = randn(num_pages, page_size, kv_heads, head_dim, dtype=dtype, gen=gen)
    # K and V as strided slices of one fused projection, as the model produces them.
    fused = randn(tokens, 2 * kv_heads * head_dim + 5, dtype=dtype, gen=gen)
    k = fused[:, 5:5 + kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = fused[:, 5 + kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens].to(DEVICE)
    slots[2] = -1  # padding row: not stored
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, expected_k, expected_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_empty_and_argument_checks():
    k_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    empty = torch.zeros(0, 1, 16, device=DEVICE)
    store_kv(empty, empty, k_cache, k_cache.clone(), torch.zeros(0, dtype=torch.int64, device=DEVICE))
    k = torch.ones(3, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="slots has"):
        store_kv(k, k, k_cache, k_cache.clone(), torch.arange(2, device=DEVICE))
    with pytest.raises(ValueError, match="heads/dim"):
        store_kv(k[..., :8], k[..., :8], k_cache, k_cache.clone(), torch.arange(3, device=DEVICE))
