"""The native CRC-32C (kvtransfer/native): the standard values, over pool pages without a copy, over
iovecs, and the copy that hashes on the way."""

import numpy as np
import pytest
import torch

from tandem.kvtransfer.native import crc32c
from tandem.kvtransfer.protocol.checksum import page_view, pages_sum
from tandem.kvtransfer.protocol.iovec import page_iov
from tests.kvtransfer.helpers import BIGGER, SMALL, random_pool

CRC = crc32c()
pytestmark = pytest.mark.skipif(CRC is None, reason="no C compiler here: the native CRC-32C is not built")


def reference(data: bytes, crc: int = 0) -> int:
    """CRC-32C bit by bit, as the standard defines it (reflected polynomial 0x82F63B78)."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def test_the_standard_check_value_and_lengths_around_the_lanes():
    assert CRC(b"123456789") == 0xE3069283               # RFC 3720's check value
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 8, 9, 383, 384, 385, 767, 768, 1000, 6144 + 5):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert CRC(data) == reference(data), n
        assert CRC(data[n // 3:], CRC(data[:n // 3])) == reference(data), n     # continues like zlib.crc32


def _region_major(pool: torch.Tensor, runs) -> bytes:
    """The runs' pages region-major, run-minor: every (layer, K|V) region, each run's pages in order."""
    regions = pool.view(pool.shape[0] * 2, pool.shape[2], -1)
    return b"".join(regions[g, s:s + n].contiguous().view(torch.uint8).numpy().tobytes()
                    for g in range(regions.shape[0]) for s, n in runs)


@pytest.mark.parametrize("layout", [SMALL, BIGGER])
def test_pages_iovecs_and_the_checksum_of_a_piece_agree_with_the_bytes(layout):
    pool = random_pool(layout, 3)
    runs = np.array([[5, 3], [1, 1], [20, 4]], dtype=np.int64)
    expected = reference(_region_major(pool, runs.tolist()))
    assert CRC.pages(page_view(pool, layout), runs) == expected
    assert pages_sum(page_view(pool, layout), runs, "crc32c") == expected
    regions = np.arange(layout.num_layers * 2, dtype=np.int64) * layout.num_pages
    iov = page_iov(pool.data_ptr(), regions, runs[:, 0], runs[:, 1], layout.page_bytes)
    assert CRC.iov(iov) == expected
    assert CRC.iov(iov[7:], CRC.iov(iov[:7])) == expected


def test_the_copy_moves_the_pages_and_hashes_what_it_read():
    src, dst = random_pool(BIGGER, 4), torch.zeros(BIGGER.shape, dtype=BIGGER.torch_dtype)
    runs = np.array([[3, 40, 2], [10, 0, 1], [0, 12, 4]], dtype=np.int64)
    regions = BIGGER.num_layers * 2
    value = CRC.copy_runs(dst, src, regions, BIGGER.page_bytes, runs, True)
    for s, d, n in runs.tolist():
        assert torch.equal(dst[:, :, d:d + n].view(torch.int16), src[:, :, s:s + n].view(torch.int16))
    assert value == CRC.pages(page_view(src, BIGGER), runs[:, [0, 2]]) == CRC.pages(page_view(dst, BIGGER), runs[:, 1:])
    assert CRC.copy_runs(dst, src, regions, BIGGER.page_bytes, runs, False) is None


def test_runs_outside_the_pool_are_refused_before_any_byte_is_read():
    pool = random_pool(SMALL, 5)
    for bad in ([[SMALL.num_pages - 1, 2]], [[-1, 1]], [[0, -1]]):
        with pytest.raises(ValueError, match="outside"):
            CRC.pages(page_view(pool, SMALL), np.array(bad))
    with pytest.raises(ValueError, match="outside"):
        CRC.copy_runs(pool.clone(), pool, SMALL.num_layers * 2, SMALL.page_bytes, np.array([[0, SMALL.num_pages, 1]]), False)
