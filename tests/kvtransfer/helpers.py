"""Shared by the kvtransfer tests and their child process: pools with known bytes, waiting, a child."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
import uuid
from collections.abc import Callable

import torch

from tandem.kvtransfer.base import PoolLayout, RoomStatus

SMALL = PoolLayout(num_layers=2, num_pages=64, page_size=4, kv_heads=2, head_dim=8, dtype="bfloat16")
BIGGER = PoolLayout(num_layers=4, num_pages=256, page_size=16, kv_heads=4, head_dim=64, dtype="bfloat16")
SMALL_LF = dataclasses.replace(SMALL, kv_layout="layer_first")
BIGGER_LF = dataclasses.replace(BIGGER, kv_layout="layer_first")


def random_pool(layout: PoolLayout, seed: int) -> torch.Tensor:
    """A pool whose every byte is random (bit patterns, not values: NaNs included)."""
    buf = torch.empty(layout.shape, dtype=layout.torch_dtype)
    raw = buf.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))
    return buf


def wire_bytes(pool: torch.Tensor, layout: PoolLayout, runs: list[tuple[int, int]],
               layers: tuple[int, int] | None = None) -> bytes:
    """The runs' pages of `layers` (None: all) in the order a tcp WRITE sends them, spelt out per layout:
    page-first, page by page; layer-first, each (layer, K|V) region's runs in turn."""
    first, end = layers or (0, layout.num_layers)
    if layout.page_first:
        parts = [pool[p, first:end] for s, n in runs for p in range(s, s + n)]
    else:
        parts = [pool[layer, kv, s:s + n] for layer in range(first, end) for kv in (0, 1) for s, n in runs]
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts)


def page_bytes(buf: torch.Tensor, pages: list[int], layout: PoolLayout) -> list[bytes]:
    """Each page's bytes over all layers and K/V (in page-first order, whatever the pool's layout)."""
    by_page = layout.by_page(buf)
    return [by_page[p].contiguous().view(torch.uint8).numpy().tobytes() for p in pages]


def wait_done(status: Callable[[], RoomStatus], timeout: float = 10.0) -> RoomStatus:
    deadline = time.monotonic() + timeout
    while True:
        st = status()
        if st.state.done or time.monotonic() > deadline:
            return st
        time.sleep(0.002)


def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Child:
    """A spawned process hosting receivers/senders, driven over a Pipe (see peer_proc.py)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        from tests.kvtransfer import peer_proc

        self.proc = ctx.Process(target=peer_proc.main, args=(child_conn,), daemon=True)
        self.proc.start()
        child_conn.close()

    def call(self, method: str, *args, timeout: float = 30.0):
        self._conn.send((method, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"child did not answer {method} within {timeout}s")
        ok, value = self._conn.recv()
        if not ok:
            raise value
        return value

    def remote(self, key: str) -> Remote:
        return Remote(self, key)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (TimeoutError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


class Remote:
    """A receiver or sender living in a child: method calls are forwarded."""

    def __init__(self, child: Child, key: str):
        self._child, self._key = child, key

    _HOST_HELPERS = frozenset({"pages", "wait", "abort_and_snapshot", "segment_path"})

    def __getattr__(self, method: str):
        if method in self._HOST_HELPERS:
            return lambda *args: self._child.call(method, self._key, *args)
        return lambda *args: self._child.call("call", self._key, method, *args)
