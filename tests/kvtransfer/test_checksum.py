"""Checksums of KV pages in flight (protocol/checksum.py): what they cover, and their frame body."""

import zlib

import numpy as np
import pytest
import torch

from tandem.kvtransfer.protocol import checksum
from tandem.kvtransfer.protocol.checksum import (
    ChecksumPool,
    available,
    choose,
    page_view,
    pages_sum,
    parse_sums,
    sums_body,
)
from tandem.kvtransfer.protocol.wire import ProtocolError
from tests.kvtransfer.helpers import BIGGER, BIGGER_LF, SMALL, SMALL_LF, random_pool


def _end_to_end(pool: torch.Tensor, layout, runs: list[tuple[int, int]]) -> bytes:
    """The runs' pages end to end, each page's (layer, K|V) regions in order."""
    pages = [layout.by_page(pool)[s:s + n].contiguous() for s, n in runs]
    return b"".join(p.view(torch.uint8).numpy().tobytes() for p in pages)


@pytest.mark.parametrize("layout", [SMALL, BIGGER, SMALL_LF, BIGGER_LF])
def test_a_pieces_checksum_is_the_hash_of_its_pages_end_to_end(layout, monkeypatch):
    pool = random_pool(layout, 5)
    runs = [(7, 3), (0, 1), (layout.num_pages - 2, 2)]
    expected = zlib.crc32(_end_to_end(pool, layout, runs))
    assert pages_sum(page_view(pool, layout), np.array(runs), "crc32") == expected
    monkeypatch.setattr(checksum, "CHUNK_BYTES", 1)       # a page at a time: the same value
    assert pages_sum(page_view(pool, layout), np.array(runs), "crc32") == expected
    if "xxh3" in available():
        import xxhash

        assert pages_sum(page_view(pool, layout), np.array(runs), "xxh3") == xxhash.xxh3_64_intdigest(
            _end_to_end(pool, layout, runs))


@pytest.mark.parametrize("layout", [SMALL, SMALL_LF])
@pytest.mark.parametrize("algorithm", available())
def test_any_flipped_byte_of_its_pages_changes_a_checksum_and_no_other_byte_does(algorithm, layout):
    pool = random_pool(layout, 6)
    pages, runs = page_view(pool, layout), np.array([[2, 3], [10, 1]])
    before = pages_sum(pages, runs, algorithm)
    raw = layout.by_page(pool.view(torch.uint8))
    for layer, kv, page in [(0, 0, 2), (1, 1, 4), (0, 1, 10)]:
        raw[page, layer, kv].view(-1)[5] ^= 0x10
        assert pages_sum(pages, runs, algorithm) != before
        raw[page, layer, kv].view(-1)[5] ^= 0x10
    layout.by_page(pool)[20] = 0                            # outside the runs: no effect
    assert pages_sum(pages, runs, algorithm) == before


def test_the_pool_checksums_on_its_threads():
    pool = random_pool(BIGGER, 7)
    sums = ChecksumPool(pool, BIGGER, "test-sums", threads=2)
    try:
        runs = np.array([[1, 5], [100, 20]], dtype=np.int64)
        assert sums.submit(runs, "crc32").result(10) == pages_sum(page_view(pool, BIGGER), runs, "crc32")
    finally:
        sums.close()
        sums.close()


def test_a_process_pinned_to_one_core_checks_on_one_thread(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {1}, raising=False)
    sums = ChecksumPool(random_pool(SMALL, 1), SMALL, "test-sums")
    try:
        assert sums._ex._max_workers == 1
    finally:
        sums.close()


def test_the_sender_uses_the_receivers_first_choice_it_has_too():
    assert available()[-1] == "crc32"                      # the standard library's: always there
    assert choose(["xxh3", "crc32"], ("crc32",)) == "crc32"
    assert choose(["xxh3", "crc32"], ("xxh3", "crc32")) == "xxh3"
    assert choose([], ("crc32",)) == "" and choose(["md5"], ("crc32",)) == ""


def test_sums_body_round_trip_and_bad_bodies():
    runs = np.array([[3, 2], [9, 1]], dtype=np.int64)
    got_runs, value = parse_sums(sums_body(runs, 0xFFFFFFFFFFFFFFFF))
    assert got_runs.tolist() == runs.tolist() and value == 0xFFFFFFFFFFFFFFFF
    for bad in (b"", b"x" * 8, b"x" * 23, sums_body(np.array([[3, 0]]), 1)):
        with pytest.raises(ProtocolError):
            parse_sums(bad)
