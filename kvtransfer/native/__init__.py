"""Native helpers of the transfer layer: plain C compiled where it runs (like kernels/cpu, cached by
content under `$TANDEM_CACHE_DIR/cpu_ops` and built by `make install`), loaded with ctypes (no
Python or torch headers; ctypes releases the GIL for each call). `crc32c()` is None where it cannot be
built (no C compiler): the transfer layer then offers only the checksums it has without it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path

import numpy as np
import torch

from tandem.kernels.cpu import cache_dir
from tandem.kernels.cpu.build import Artifact, cached, compiler_id, digest, run
from tandem.kvtransfer.base import Geometry

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCE = "crc32c.c"
FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-fvisibility=default"]


def build(verbose: bool = False) -> Path:
    """The shared library's path, compiled first if no process has yet. Raises what went wrong."""
    cc = os.environ.get("CC") or "cc"
    source = (HERE / SOURCE).read_bytes()
    key = digest([SOURCE, source, *FLAGS, compiler_id(cc), platform.machine()])

    def compile_lib(tmp: Path) -> None:
        (tmp / SOURCE).write_bytes(source)
        run([cc, *FLAGS, SOURCE, "-o", "libtandem_crc32c.so"], tmp, verbose)

    return cached(cache_dir(), Artifact("crc32c", key, "libtandem_crc32c.so", compile_lib,
                                          "the KV checksums' CRC-32C", 1.0, announce=False))


PATHS = ("table", "crc32 instruction", "carry-less fold")


class Crc32c:
    """CRC-32C (Castagnoli) from the compiled library: `level` says which path computes it (PATHS, the
    fastest the CPU has: a carry-less multiply fold with VPCLMULQDQ, else the crc32 instruction, else a
    table ~10x slower; same results), `hw` whether an instruction does."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        u32, size, i64, ptr = ctypes.c_uint32, ctypes.c_size_t, ctypes.c_int64, ctypes.c_void_p
        lib.tandem_crc32c_init.restype = ctypes.c_int
        lib.tandem_crc32c_update.argtypes = [u32, ptr, size]
        lib.tandem_crc32c_runs.argtypes = [u32, ptr, i64, i64, i64, i64, ptr, i64]
        lib.tandem_crc32c_iov.argtypes = [u32, ptr, i64]
        lib.tandem_copy_runs.argtypes = [u32, ctypes.c_int, ptr, ptr, i64, i64, i64, i64, i64, ptr, i64]
        for fn in (lib.tandem_crc32c_update, lib.tandem_crc32c_runs, lib.tandem_crc32c_iov, lib.tandem_copy_runs):
            fn.restype = u32
        lib.tandem_crc32c_use.argtypes = [ctypes.c_int]
        lib.tandem_crc32c_use.restype = ctypes.c_int
        self._lib = lib
        self.level = lib.tandem_crc32c_init()         # the library's tables, filled before any thread calls in

    @property
    def hw(self) -> bool:
        """An instruction computes it (not the table)."""
        return self.level >= 1

    def use(self, level: int) -> int:
        """Hash with at most path `level` from now on (PATHS: 0 the table, 1 the crc32 instruction, 2
        the carry-less fold), where the CPU has it; returns the level in effect. For tests and
        benchmarks, while no other thread hashes."""
        self.level = self._lib.tandem_crc32c_use(level)
        return self.level

    def __call__(self, data, value: int = 0) -> int:
        """The CRC-32C of `data` (a contiguous buffer), continuing from `value` (zlib.crc32's convention:
        crc(a + b) == crc(b, crc(a)))."""
        buf = np.frombuffer(data, dtype=np.uint8)
        return ~self._lib.tandem_crc32c_update(~value & _MASK, buf.ctypes.data, buf.nbytes) & _MASK

    def pages(self, pages: np.ndarray, runs: np.ndarray) -> int:
        """The CRC-32C of the pages of `runs` `[n, 2]` (start, length) of `pages`, a `[page, region,
        byte]` view of a pool (checksum.page_view: each page's piece contiguous), region-major, then
        run, then page (the order a tcp WRITE sends them), without copying them anywhere."""
        n_pages, regions, piece = pages.shape
        if pages.strides[2] != 1 or pages.strides[0] < piece:
            raise ValueError("not a page view of a pool")
        runs = _runs(runs, 2, n_pages, n_pages)
        raw = self._lib.tandem_crc32c_runs(_MASK, pages.ctypes.data, regions, pages.strides[1], piece,
                                           pages.strides[0], runs.ctypes.data, len(runs))
        return ~raw & _MASK

    def iov(self, iov: np.ndarray, value: int = 0) -> int:
        """The CRC-32C of the bytes iovecs `[n, 2]` (address, length) point at, in order, continuing from
        `value`. The caller guarantees the memory (as for send_iov)."""
        iov = np.ascontiguousarray(iov, dtype=np.uint64)
        return ~self._lib.tandem_crc32c_iov(~value & _MASK, iov.ctypes.data, len(iov)) & _MASK

    def copy_runs(self, dst: torch.Tensor, src: torch.Tensor, dst_geometry: Geometry, src_geometry: Geometry,
                  runs: np.ndarray, sum: bool) -> int | None:
        """Copies runs `[n, 3]` (src_start, dst_start, length) of a write of `src_geometry` in pool `src`
        to the same place (`dst_geometry`: the same write in a pool of another size) in pool `dst`
        (both contiguous); with `sum`, returns the CRC-32C of the source bytes in `pages`'s order (what
        `pages` gives on either pool after the copy), hashed while they are in cache."""
        s, d = src_geometry, dst_geometry
        if (s.regions, s.piece, s.page_stride, s.offset) != (d.regions, d.piece, d.page_stride, d.offset):
            raise ValueError(f"copy between different geometries {s} and {d}")
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("pools must be contiguous")
        runs = _runs(runs, 3, _pages(src, s), _pages(dst, d))
        raw = self._lib.tandem_copy_runs(_MASK, int(sum), dst.data_ptr() + d.offset, src.data_ptr() + s.offset,
                                         s.regions, d.region_stride, s.region_stride, s.piece, s.page_stride,
                                         runs.ctypes.data, len(runs))
        return ~raw & _MASK if sum else None


def _pages(pool: torch.Tensor, g: Geometry) -> int:
    """Pages of `pool` a write of geometry `g` may touch (its last region ends inside the pool)."""
    end = pool.numel() * pool.element_size() - g.offset - (g.regions - 1) * g.region_stride - g.piece
    return end // g.page_stride + 1 if end >= 0 else 0


_MASK = 0xFFFFFFFF


def _runs(runs: np.ndarray, width: int, *limits: int) -> np.ndarray:
    """`runs` as contiguous int64 `[n, width]`, every run inside its pool (start columns then length)."""
    runs = np.ascontiguousarray(runs, dtype=np.int64).reshape(-1, width)
    if len(runs):
        n = runs[:, -1]
        if n.min() < 0 or any(runs[:, k].min() < 0 or (runs[:, k] + n).max() > lim for k, lim in enumerate(limits)):
            raise ValueError("runs outside the pool")
    return runs


@functools.cache
def crc32c() -> Crc32c | None:
    """The compiled CRC-32C, built on first use; None (logged once) where it cannot be built."""
    try:
        return Crc32c(build())
    except Exception as exc:     # no C compiler, a read-only cache: the other checksums remain
        log.warning("the native CRC-32C is unavailable (KV checksums use xxh3/crc32): %s", str(exc).strip()[-800:])
        return None
