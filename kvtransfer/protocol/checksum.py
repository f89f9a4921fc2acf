"""Checksums of KV pages in flight: what keeps a transfer from being silently wrong (docs/resilience.md,
"KV integrity").

P checksums each piece of a write (a few page runs, at most PIECE_BYTES: the sender cuts writes into
pieces) over the pages it reads from its own pool and sends the value in a SUMS frame after the
piece; D recomputes it over the same pages in its own pool once they landed, before the room may
succeed.

Algorithms, in order of preference (a receiver advertises those it has, the sender uses the first of
them it has too, wire.py):
- `crc32c`: the standard CRC-32C of the piece's pages in the order a tcp WRITE puts them on the wire
  (region-major, then run, then page: `PoolLayout.geometry`; page-first pools have one region, a
  page of every layer of the write in one piece), computed by Tandem's
  native helper (kvtransfer/native: the CPU's crc32 instruction on three lanes, straight from pool
  memory, no copy) where it builds and the CPU has SSE4.2. The data paths that move bytes with the
  CPU compute it on the way, while each chunk is in cache (`Link.sums_inline`,
  `Incoming.receive_summed`): tcp on both sides (P hashes each chunk it just sent, D each chunk
  just received), shm on P (hashes each chunk it just copied); D's shm check and every check on
  nixl/ucx run on the checksum threads.
- `xxh3`: XXH3-64 of the piece's pages end to end, page-major (each page's bytes of every region in
  region order; a WRITE_LAYERS piece: of its layers' regions only, as for crc32c), from the `xxhash` package where it is installed; the pages are copied a few MiB at
  a time into a staging buffer that stays in cache and hashed from there.
- `crc32`: zlib's CRC-32 (standard library, always there), same order as xxh3, 2-3x slower.
Checks not done on the way run on a few threads (`ChecksumPool`; ctypes, the copies and the hashing
release the GIL): P checksums a piece while it is sent, D checks one piece while the next one lands.
What the checks cost: docs/benchmarks.md, "What the KV checksums cost".

SUMS frame body (wire.py): int64 `[n, 2]` (dst_start, length), the runs of the write just before it,
then the checksum as a little-endian uint64.
"""

from __future__ import annotations

import functools
import importlib
import os
import struct
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from tandem.kvtransfer.base import PoolLayout
from tandem.kvtransfer.protocol.wire import ProtocolError

PIECE_BYTES = 8 << 20            # a checked write is sent in pieces of at most this many bytes
CHUNK_BYTES = 2 << 20            # pages gathered (and hashed) at a time
MAX_THREADS = 4
_VALUE = struct.Struct("<Q")


class _Crc32:
    """zlib's CRC-32 with xxhash's streaming interface."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


# name -> a new streaming hash (`update(bytes)`, `intdigest()`), preferred first. A factory may raise
# ImportError: the algorithm is then not available in this process.
_ALGORITHMS: dict[str, Callable[[], Callable[[], object]]] = {
    "crc32c": lambda: _native_crc32c(),
    "xxh3": lambda: importlib.import_module("xxhash").xxh3_64,
    "crc32": lambda: _Crc32,
}


SUMMED_CHUNK_BYTES = 1 << 20


def native_crc32c():
    """The native CRC-32C (kvtransfer.native.Crc32c) where it is built and fast here, else None."""
    from tandem.kvtransfer.native import crc32c

    fn = crc32c()
    return fn if fn is not None and fn.hw else None    # without the instruction a table is slower than xxh3


def _native_crc32c():
    fn = native_crc32c()
    if fn is None:
        raise ImportError("no hardware CRC-32C here")
    return fn


@functools.cache
def available() -> tuple[str, ...]:
    """The algorithms this process can compute, preferred first (`crc32` always)."""
    names = []
    for name, factory in _ALGORITHMS.items():
        try:
            factory()
            names.append(name)
        except ImportError:
            pass
    return tuple(names)


@functools.cache
def _new(name: str) -> Callable[[], object]:
    return _ALGORITHMS[name]()


def choose(offered: tuple[str, ...] | list[str], usable: tuple[str, ...]) -> str:
    """The first algorithm of `offered` (a receiver's, in its order) in `usable`; "" if none."""
    return next((name for name in offered if name in usable), "")


def page_view(pool: torch.Tensor, layout: PoolLayout, layers: tuple[int, int] | None = None) -> np.ndarray:
    """A contiguous CPU pool's bytes of a write of `layers` (None: every layer) as `[page, region,
    byte]` (a view, no copy; `PoolLayout.geometry`)."""
    data = pool.view(-1).view(torch.uint8).numpy()
    g = layout.geometry(layers)
    return np.lib.stride_tricks.as_strided(data[g.offset:], (layout.num_pages, g.regions, g.piece),
                                           (g.page_stride, g.region_stride, 1), writeable=False)


_staging = threading.local()


def _stage(nbytes: int) -> np.ndarray:
    """This thread's staging buffer (kept: a fresh large buffer costs page faults each time)."""
    buf = getattr(_staging, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _staging.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def pages_sum(pages: np.ndarray, runs: np.ndarray, algorithm: str) -> int:
    """The checksum `algorithm` of the pages of runs `[n, 2]` (start, length) of the pool whose
    `page_view` is `pages`, in that algorithm's order (above)."""
    if algorithm == "crc32c":
        return _new(algorithm).pages(pages, runs)
    _, regions, pb = pages.shape
    per_chunk = max(1, CHUNK_BYTES // (regions * pb))
    stage = _stage(per_chunk * regions * pb).reshape(per_chunk, regions, pb)
    h = _new(algorithm)()
    k = 0                        # pages staged
    for start, n in np.asarray(runs, dtype=np.int64).reshape(-1, 2).tolist():
        while n:
            m = min(n, per_chunk - k)
            stage[k:k + m] = pages[start:start + m]      # one strided copy: m pages of every region
            start, n, k = start + m, n - m, k + m
            if k == per_chunk:
                h.update(stage)
                k = 0
    if k:
        h.update(stage[:k])
    return h.intdigest()


def piece_pages(layout: PoolLayout, layers: int | None = None) -> int:
    """Pages per piece of a checked write of `layers` layers (default: all; at least one page)."""
    return max(1, PIECE_BYTES // (layout.page_bytes * (layers or layout.num_layers) * 2))


def _usable_cores() -> int:
    """Cores this process may run on (its affinity: a worker `tandem up` pinned to one core checks on
    one thread, where a second would only take turns with the first and with the engine)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ChecksumPool:
    """Checksums over one pool, computed on a few threads of their own (started on first use). `close`
    drops what has not started; safe to call twice."""

    def __init__(self, pool: torch.Tensor, layout: PoolLayout, name: str, threads: int | None = None):
        self._pool, self._layout = pool, layout
        self._pages = page_view(pool, layout)
        threads = threads or min(MAX_THREADS, _usable_cores())
        self._ex = ThreadPoolExecutor(threads, thread_name_prefix=name)

    def submit(self, runs: np.ndarray, algorithm: str, layers: tuple[int, int] | None = None) -> Future:
        """The future `pages_sum` of runs `[n, 2]` (start, length), of `layers` (first, end) only if given."""
        pages = self._pages if layers is None else page_view(self._pool, self._layout, layers)
        return self._ex.submit(pages_sum, pages, np.array(runs, dtype=np.int64), algorithm)

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)


def sums_body(runs: np.ndarray, value: int) -> bytes:
    """A SUMS frame's body: runs `[n, 2]` (dst_start, length) and their checksum."""
    return np.ascontiguousarray(runs, dtype="<i8").tobytes() + _VALUE.pack(value)


def parse_sums(body: bytes) -> tuple[np.ndarray, int]:
    """(runs `[n, 2]` (dst_start, length), checksum) of a SUMS body. Raises ProtocolError."""
    if len(body) < _VALUE.size + 16 or (len(body) - _VALUE.size) % 16:
        raise ProtocolError(f"SUMS body of {len(body)} bytes")
    runs = np.frombuffer(body, dtype="<i8", count=(len(body) - _VALUE.size) // 8).reshape(-1, 2)
    if (runs[:, 1] <= 0).any():
        raise ProtocolError("SUMS with an empty run")
    return runs, _VALUE.unpack_from(body, len(body) - _VALUE.size)[0]
