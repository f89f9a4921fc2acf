"""The native CRC-32C (kvtransfer/native): the standard values, over pool pages without a copy, over
iovecs, and the copy that hashes on the way."""

import dataclasses

import numpy as np
import pytest
import torch

from tandem.kvtransfer.native import PATHS, crc32c
from tandem.kvtransfer.protocol.checksum import page_view, pages_sum
from tandem.kvtransfer.protocol.iovec import page_iov, split_iov
from tests.kvtransfer.helpers import BIGGER, BIGGER_LF, SMALL, SMALL_LF, random_pool, wire_bytes

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


@pytest.fixture(params=range(len(PATHS)), ids=PATHS)
def path(request):
    """Each path the CPU has (the fold, the crc32 instruction, the table), then the best again."""
    if CRC.use(request.param) != request.param:
        CRC.use(len(PATHS))
        pytest.skip(f"this CPU has no {PATHS[request.param]} path")
    yield request.param
    CRC.use(len(PATHS))


def test_every_path_gives_the_standard_crc_around_its_blocks(path):
    rng = np.random.default_rng(2)
    lengths = (0, 5, 255, 256, 257, 511, 512, 513, 2048 + 17, 6144, 32 << 10) if path else (0, 5, 257, 513)
    for n in lengths:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert CRC(data) == reference(data), n
        assert CRC(data[n // 3:], CRC(data[:n // 3])) == reference(data), n
        assert CRC(b"\0" * n, 0x12345678) == reference(b"\0" * n, 0x12345678), n   # a register that is not ~0


def test_the_paths_agree_on_a_copy_that_hashes(path):
    pool = random_pool(BIGGER, seed=3)
    dst = torch.zeros_like(pool)
    runs = np.array([[0, 2, 3], [5, 0, 1]], dtype=np.int64)
    g = BIGGER.geometry()
    got = CRC.copy_runs(dst, pool, g, g, runs, True)
    assert got == reference(wire_bytes(pool, BIGGER, runs[:, [0, 2]]))


@pytest.mark.parametrize("layout", [SMALL, BIGGER, SMALL_LF, BIGGER_LF])
@pytest.mark.parametrize("layers", [None, (1, 2)])
def test_pages_iovecs_and_the_checksum_of_a_piece_agree_with_the_bytes(layout, layers):
    pool = random_pool(layout, 3)
    runs = np.array([[5, 3], [1, 1], [20, 4]], dtype=np.int64)
    expected = reference(wire_bytes(pool, layout, runs.tolist(), layers))
    assert CRC.pages(page_view(pool, layout, layers), runs) == expected
    assert pages_sum(page_view(pool, layout, layers), runs, "crc32c") == expected
    iov = page_iov(pool.data_ptr(), layout.geometry(layers), runs[:, 0], runs[:, 1])
    assert CRC.iov(iov) == expected
    assert CRC.iov(iov[3:], CRC.iov(iov[:3])) == expected
    assert CRC.iov(split_iov(iov, 100)) == expected


@pytest.mark.parametrize("layout", [BIGGER, BIGGER_LF])
def test_the_copy_moves_the_pages_and_hashes_what_it_read(layout):
    """Between pools of different sizes (D's is bigger), as shm copies them."""
    bigger = dataclasses.replace(layout, num_pages=layout.num_pages + 9)
    src, dst = random_pool(layout, 4), torch.zeros(bigger.shape, dtype=layout.torch_dtype)
    runs = np.array([[3, 40, 2], [10, 0, 1], [0, 12, 4], [5, bigger.num_pages - 1, 1]], dtype=np.int64)
    value = CRC.copy_runs(dst, src, bigger.geometry(), layout.geometry(), runs, True)
    for s, d, n in runs.tolist():
        assert torch.equal(bigger.by_page(dst)[d:d + n].view(torch.int16), layout.by_page(src)[s:s + n].view(torch.int16))
    assert layout.by_page(dst)[20:40].abs().sum() == 0
    assert value == CRC.pages(page_view(src, layout), runs[:, [0, 2]]) == CRC.pages(page_view(dst, bigger), runs[:, 1:])
    assert CRC.copy_runs(dst, src, bigger.geometry(), layout.geometry(), runs, False) is None


def test_runs_outside_the_pool_are_refused_before_any_byte_is_read():
    pool = random_pool(SMALL, 5)
    for bad in ([[SMALL.num_pages - 1, 2]], [[-1, 1]], [[0, -1]]):
        with pytest.raises(ValueError, match="outside"):
            CRC.pages(page_view(pool, SMALL), np.array(bad))
    for layout in (SMALL, SMALL_LF):
        with pytest.raises(ValueError, match="outside"):
            CRC.copy_runs(pool.clone(), pool, layout.geometry(), layout.geometry(),
                          np.array([[0, SMALL.num_pages, 1]]), False)
    with pytest.raises(ValueError, match="different geometries"):
        CRC.copy_runs(pool.clone(), pool, SMALL.geometry(), SMALL.geometry((0, 1)), np.array([[0, 0, 1]]), False)
