"""KV transfer throughput: every backend (shm, tcp, nixl, ucx, auto) between two processes, beside the
floors they compete with, all in one run with repeats interleaved in a shuffled order (the cores are
shared, so ratios within one run are what count).

    python -m tandem.bench.kvtransfer --out bench/results/kvtransfer.json

SmolLM2-shaped pages (30 layers, K and V, page_size 16, 3 KV heads, head_dim 64, bf16: 6 KiB per
page per layer-K, 360 KiB per page), a pool of `--pool-pages` on each side in `--kv-layout` (page_first:
a page is one piece; layer_first: 60 pieces), `--move` pages scattered at random over both pools. Rows:
- `copy_1proc`: the same scattered src->dst copy inside one process with the best torch path (one
  `copy_` per merged run over all layers and K/V, strided in a layer-first pool; `index_put` is shown
  beside it).
- `copy_1proc_one_run`: the same byte count copied as one run of consecutive pages (the cost of
  scattered memory access, without any socket).
- `raw_socket`: plain `sendall` / `recv_into` of the same byte count, contiguous, over 127.0.0.1.
- `raw_socket_sg`: the same socket moving the same scattered pages with gather/scatter `sendmsg` /
  `recvmsg` (what the tcp backend does underneath, without its protocol).
- `tcp`, `shm`, `nixl`, `ucx`: the backends, timed from `write()` until P sees SUCCESS (which D sends
  after it has stored the aux record), so the time until D sees the aux record is included. `D ms` is
  D's own RoomStatus.seconds (first byte of the room -> aux record). `nixl` uses UCX's default
  transports (on one host: cma for the writes); `ucx` keeps UCX peer-failure detection (tcp).
- `nixl_tcp`: nixl with the sender's UCX_TLS=tcp: what nixl gets between CPU hosts without RDMA.
- `*_one_run`: the backend moving the same byte count as one run of consecutive pages.
- `auto`: what `auto` picks on one host (shm); `auto_remote`: what it picks when D's shared memory is on
  another host (the metadata says so: tcp). The targets compare each with the best backend for that
  situation.
- `*_unchecked`: the backend with the sender's checksums off (no SUMS frames, no pieces, nothing
  checked on D); `checksum_cost` is how much longer the checked row takes (target <= 5%). The plain
  rows check with the best algorithm this process has (kvtransfer/protocol/checksum.py: xxh3 where
  the xxhash package is installed, else crc32); `*_crc32` rows force crc32 where it is not the best.
  `sums_<algorithm>_1thread` / `_pool`: the checksums of the moved pages alone, in the sender's pieces,
  on one thread and on a `ChecksumPool` (what each side computes).

`--backends shm,tcp` runs only those backends' rows (auto and the one-run, nixl_tcp and unchecked
rows follow theirs), e.g. where nixl or ucxx are not installed.

Receivers are shared where the data path is the same (the shm row's sender writes into the auto
receiver's shared-memory pool), to keep the memory of the run at about 11 GB with the default pools.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import multiprocessing as mp
import os
import platform
import random
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from tandem.bench.flags import add_out_flag
from tandem.bench.results import write_result
from tandem.kvtransfer import create_receiver, create_sender, merge_runs
from tandem.kvtransfer.backends.ucx_env import UcxSettings
from tandem.kvtransfer.base import PoolLayout, RoomState
from tandem.kvtransfer.protocol import checksum
from tandem.kvtransfer.protocol.checksum import ChecksumPool, available, page_view, pages_sum, piece_pages
from tandem.kvtransfer.protocol.iovec import page_iov, recv_iov, send_iov
from tandem.kvtransfer.protocol.runs import split_runs

# The backends that work in each situation (auto's choice is compared with the best of them).
SAME_HOST = ("shm", "tcp", "nixl", "ucx")
REMOTE = ("tcp", "nixl_tcp", "ucx")     # ucx here already runs over tcp (it keeps peer-failure detection)


def smollm2_layout(pages: int, kv_layout: str = "page_first") -> PoolLayout:
    return PoolLayout(num_layers=30, num_pages=pages, page_size=16, kv_heads=3, head_dim=64, dtype="bfloat16",
                      kv_layout=kv_layout)


def _byte_view(t: torch.Tensor) -> np.ndarray:
    return t.view(-1).view(torch.uint8).numpy()


def _sg_iov(buf: torch.Tensor, layout: PoolLayout, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return page_iov(buf.data_ptr(), layout.geometry(), starts, lengths)


# ---- child processes -----------------------------------------------------------------------------------

CLONE_NEWNET = 0x40000000


def enter_netns(ns: str) -> None:
    """Move this (single-threaded, socket-less) process into network namespace `ns`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


def receiver_child(conn, backend: str, layout: PoolLayout, options: dict, threads: int,
                   host: str = "127.0.0.1", netns: str | None = None) -> None:
    if netns:
        enter_netns(netns)                               # before any socket or thread exists
    checksum.MAX_THREADS = threads                       # this run's --checksum-threads, in this process too
    rx = create_receiver(backend, layout, host, f"D-{backend}", **options)
    rx.buffer.zero_()                                   # touch every page once, as a running D would have
    conn.send(rx.metadata())
    while True:
        cmd, *args = conn.recv()
        if cmd == "expect":
            rx.expect(*args)
            conn.send(None)
        elif cmd == "poll":
            conn.send(rx.poll(args[0]))
        elif cmd == "release":
            rx.release(args[0])
            conn.send(None)
        else:
            rx.close()
            conn.send(None)
            return


def raw_child(conn, layout: PoolLayout, nbytes: int, dst_runs: np.ndarray) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    staging = np.ones(nbytes, dtype=np.uint8)
    view = memoryview(staging)
    pool = torch.ones(layout.shape, dtype=layout.torch_dtype)
    iov = _sg_iov(pool, layout, dst_runs[:, 0], dst_runs[:, 1])
    while True:
        mode = sock.recv(1)
        if mode in (b"", b"q"):
            return
        if mode == b"c":
            got = 0
            while got < nbytes:
                got += sock.recv_into(view[got:], nbytes - got)
        else:
            recv_iov(sock, iov)
        sock.sendall(b"k")


# ---- the measured operations -----------------------------------------------------------------------------

class OneProcessCopy:
    def __init__(self, src: torch.Tensor, layout: PoolLayout, runs: list[tuple[int, int, int]], src_pages,
                 dst_pages):
        self.runs = runs
        self.src, self.dst = layout.by_page(src), layout.by_page(torch.zeros_like(src))   # [page, layer, K|V, ...]
        self.si, self.di = torch.tensor(src_pages), torch.tensor(dst_pages)

    def copy_loop(self) -> None:
        src, dst = self.src, self.dst
        for s, d, n in self.runs:
            dst[d:d + n].copy_(src[s:s + n])

    def one_run(self) -> None:
        n = len(self.si)
        self.dst[-n:].copy_(self.src[:n])

    def index_put(self) -> None:
        self.dst[self.di] = self.src[self.si]


class RawSocket:
    def __init__(self, port: int, pool: torch.Tensor, layout: PoolLayout, nbytes: int, src_runs: np.ndarray):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.contig = memoryview(_byte_view(pool))[:nbytes]
        self.iov = _sg_iov(pool, layout, src_runs[:, 0], src_runs[:, 1])

    def contiguous(self) -> None:
        self.sock.sendall(b"c")
        self.sock.sendall(self.contig)
        assert self.sock.recv(1) == b"k"

    def scatter_gather(self) -> None:
        self.sock.sendall(b"s")
        send_iov(self.sock, self.iov)
        assert self.sock.recv(1) == b"k"


class Checksums:
    """The checksums of the moved pages alone, in the sender's pieces: on one thread, and on a pool."""

    def __init__(self, pool: torch.Tensor, layout: PoolLayout, runs: np.ndarray):
        self.pages = page_view(pool, layout)
        self.pieces = [p[:, ::2] for p in split_runs(runs, piece_pages(layout))]
        self.pool = ChecksumPool(pool, layout, "bench-sums")

    def one_thread(self, algorithm: str) -> None:
        for p in self.pieces:
            pages_sum(self.pages, p, algorithm)

    def in_pieces(self, algorithm: str) -> None:
        for f in [self.pool.submit(p, algorithm) for p in self.pieces]:
            f.result()


class RxChild:
    """A receiver of one backend in its own process."""

    def __init__(self, name: str, layout: PoolLayout, host: str = "127.0.0.1", netns: str | None = None, **options):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=receiver_child, daemon=True,
                                args=(child_conn, name, layout, options, checksum.MAX_THREADS, host, netns))
        self.proc.start()
        if not self.conn.poll(120):
            self.proc.kill()
            raise RuntimeError(f"the {name} receiver did not start (its traceback is above)")
        self.meta = self.conn.recv()
        self.worker_id = f"D-{name}"

    def call(self, *msg):
        self.conn.send(msg)
        return self.conn.recv()

    def close(self) -> None:
        self.call("exit")
        self.proc.join(10)


class Link:
    """One row: a sender of this process writing into a receiver child through a given data path."""

    def __init__(self, row: str, rx: RxChild, backend: str, pool: torch.Tensor, layout: PoolLayout, path: str,
                 meta: bytes | None = None, **options):
        self.rx, self.peer, self.id = rx, rx.worker_id, f"P-{row}"
        self.tx = create_sender(backend, pool, layout, self.id, **options)
        self.tx.connect(self.peer, meta or rx.meta)
        assert self.tx.path_kind(self.peer) == path, (row, self.tx.path_kind(self.peer))
        self.d_seconds: list[float] = []

    def transfer(self, src: list[int], dst: list[int]) -> float:
        room = random.getrandbits(63)
        self.rx.call("expect", room, dst, self.id)
        t0 = time.perf_counter()
        self.tx.write(self.peer, room, src, dst)
        self.tx.finish(self.peer, room, b"x" * 100)
        st = self.tx.wait(room, timeout=60)              # blocks on a condition: no polling thread stealing CPU
        elapsed = time.perf_counter() - t0
        assert st.state == RoomState.SUCCESS, st
        rst = self.rx.call("poll", room)
        assert rst.state == RoomState.SUCCESS and rst.aux == b"x" * 100, rst
        self.d_seconds.append(rst.seconds)
        self.rx.call("release", room)
        self.tx.release(room)
        return elapsed


def other_host(meta: bytes) -> bytes:
    """D's metadata as a sender on another host would see it: its shared memory is out of reach."""
    d = json.loads(meta)
    d["shm"]["hostname"] = "another-host"
    return json.dumps(d).encode()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-pages", type=int, default=4096)
    ap.add_argument("--move", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-layout", choices=("page_first", "layer_first"), default="page_first",
                    help="both pools' layout (engine/kvcache/kv_pool.py)")
    ap.add_argument("--backends", default=",".join(SAME_HOST),
                    help="the backends whose rows run (default: all four)")
    ap.add_argument("--piece-mib", type=float, default=checksum.PIECE_BYTES / 2**20,
                    help="pieces a checked write is cut into, MiB (the senders of this run)")
    ap.add_argument("--checksum-threads", type=int, default=checksum.MAX_THREADS,
                    help="threads each sender and receiver of this run checksums on")
    add_out_flag(ap, type=Path)
    args = ap.parse_args()
    chosen = {b.strip() for b in args.backends.split(",") if b.strip()}
    if not chosen or chosen - set(SAME_HOST):
        ap.error(f"--backends: choose from {', '.join(SAME_HOST)}")

    checksum.PIECE_BYTES = int(args.piece_mib * 2**20)   # read by the senders made below (and Checksums)
    checksum.MAX_THREADS = args.checksum_threads
    layout = smollm2_layout(args.pool_pages, args.kv_layout)
    rng = random.Random(args.seed)
    src = rng.sample(range(layout.num_pages), args.move)
    dst = rng.sample(range(layout.num_pages), args.move)
    runs = merge_runs(src, dst)
    runs_np = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    nbytes = args.move * layout.num_layers * 2 * layout.page_bytes
    print(f"layout {layout}\nmoving {args.move} of {layout.num_pages} pages ({len(runs)} runs): "
          f"{nbytes / 1e6:.1f} MB per transfer, {args.repeats} repeats (+1 warm-up)")

    pool = torch.empty(layout.shape, dtype=layout.torch_dtype)
    pool.view(torch.int16).random_(-30000, 30000)

    ctx = mp.get_context("spawn")
    raw_conn, raw_child_conn = ctx.Pipe()
    raw_proc = ctx.Process(target=raw_child, args=(raw_child_conn, layout, nbytes, runs_np[:, 1:]), daemon=True)
    raw_proc.start()
    raw = RawSocket(raw_conn.recv(), pool, layout, nbytes, runs_np[:, [0, 2]])
    rxs = {name: RxChild(name, layout) for name in ("auto", "tcp", "nixl", "ucx")
           if name in chosen or (name == "auto" and chosen & {"shm", "tcp"})}
    # row -> (its backend among --backends, receiver, sender backend, data path, options)
    plan = {
        "tcp": ("tcp", "tcp", "tcp", "tcp", {}),
        "shm": ("shm", "auto", "shm", "shm", {}),
        "nixl": ("nixl", "nixl", "nixl", "nixl", {}),
        "nixl_tcp": ("nixl", "nixl", "nixl", "nixl", {"ucx": UcxSettings.from_env(tls="tcp")}),
        "ucx": ("ucx", "ucx", "ucx", "ucx", {}),
        "auto": ("shm", "auto", "auto", "shm", {}),
        "auto_remote": ("tcp", "auto", "auto", "tcp", {}),
        **{f"{b}_unchecked": (b, "auto" if b == "shm" else b, b, b, {"checksums": ()}) for b in SAME_HOST},
        **({f"{b}_crc32": (b, "auto" if b == "shm" else b, b, b, {"checksums": ("crc32",)}) for b in SAME_HOST}
           if available()[0] != "crc32" else {}),
    }
    links = {row: Link(row, rxs[rx], backend, pool, layout, path,
                       meta=other_host(rxs["auto"].meta) if row == "auto_remote" else None, **options)
             for row, (needs, rx, backend, path, options) in plan.items() if needs in chosen}
    # The same byte count as one run of consecutive pages on both sides: the tcp protocol's own cost
    # against the contiguous raw socket, without the scattered-memory cost.
    one_run_src = list(range(args.move))
    one_run_dst = list(range(layout.num_pages - args.move, layout.num_pages))
    local = OneProcessCopy(pool, layout, runs, src, dst)
    sums = Checksums(pool, layout, runs_np)

    ops = {
        "copy_1proc": local.copy_loop,
        "copy_1proc_index_put": local.index_put,
        "copy_1proc_one_run": local.one_run,
        "raw_socket": raw.contiguous,
        "raw_socket_sg": raw.scatter_gather,
        **{f"sums_{a}_1thread": functools.partial(sums.one_thread, a) for a in available()},
        **{f"sums_{a}_pool": functools.partial(sums.in_pieces, a) for a in available()},
    }
    one_run = {f"{name}_one_run": name for name in ("tcp", "nixl", "ucx") if name in chosen}
    transfers = {name: (links[name], src, dst) for name in links}
    transfers.update({row: (links[name], one_run_src, one_run_dst) for row, name in one_run.items()})
    for row, (link, pages_from, pages_to) in transfers.items():
        ops[row] = functools.partial(link.transfer, pages_from, pages_to)
    d_seconds: dict[str, list[float]] = {row: [] for row in transfers}
    times: dict[str, list[float]] = {k: [] for k in ops}
    cold: dict[str, float] = {}
    order = list(ops)
    for rep in range(args.repeats + 1):
        if rep:
            rng.shuffle(order)           # no row always runs right after the same other row
        for name in order:
            fn = ops[name]
            if name in transfers:
                t = fn()
                d_seconds[name].append(transfers[name][0].d_seconds[-1])
            else:
                t = timed(fn)
            if rep == 0:
                cold[name] = t
            else:
                times[name].append(t)
    # The one-process copy did what was timed (the backends' bytes are checked by tests/kvtransfer).
    local.copy_loop()
    assert torch.equal(local.dst[dst[:8]].view(torch.int16), layout.by_page(pool)[src[:8]].view(torch.int16))

    d_ms = {row: 1e3 * statistics.median(ds[1:]) for row, ds in d_seconds.items()}
    for link in links.values():
        link.tx.close()
    for rx in rxs.values():
        rx.close()
    sums.pool.close()
    raw.sock.sendall(b"q")
    raw_proc.join(10)

    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"method": name, "median_ms": 1e3 * med, "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
                     "cold_ms": 1e3 * cold[name], "gb_s": nbytes / med / 1e9,
                     **({"d_side_ms": d_ms[name]} if name in d_ms else {})})
    by = {r["method"]: r for r in rows}
    # ratio -> (row, the rows it is compared with: the best of them), where all of them ran
    specs = {
        "shm_vs_copy_1proc": ("shm", ("copy_1proc", "copy_1proc_index_put")),
        "tcp_vs_raw_socket": ("tcp", ("raw_socket",)),
        "tcp_vs_raw_socket_sg": ("tcp", ("raw_socket_sg",)),
        "raw_socket_sg_vs_raw_socket": ("raw_socket_sg", ("raw_socket",)),
        "tcp_one_run_vs_raw_socket": ("tcp_one_run", ("raw_socket",)),
        "copy_1proc_vs_copy_1proc_one_run": ("copy_1proc", ("copy_1proc_one_run",)),
        "nixl_vs_raw_socket": ("nixl", ("raw_socket",)),
        "nixl_vs_raw_socket_sg": ("nixl", ("raw_socket_sg",)),
        "nixl_one_run_vs_raw_socket": ("nixl_one_run", ("raw_socket",)),
        "nixl_tcp_vs_raw_socket": ("nixl_tcp", ("raw_socket",)),
        "ucx_vs_raw_socket": ("ucx", ("raw_socket",)),
        "ucx_one_run_vs_raw_socket": ("ucx_one_run", ("raw_socket",)),
        "auto_vs_best_same_host": ("auto", tuple(b for b in SAME_HOST if b in by)),
        "auto_remote_vs_best_remote": ("auto_remote", tuple(b for b in REMOTE if b in by)),
    }
    specs = {k: v for k, v in specs.items() if v[0] in by and v[1] and all(b in by for b in v[1])}

    def gb_s(row: str, use: str) -> float:
        return nbytes / by[row][use] * 1e3 / 1e9

    ratios = {k: gb_s(a, "median_ms") / max(gb_s(b, "median_ms") for b in bs) for k, (a, bs) in specs.items()}
    # Best-of-repeats ratios: less sensitive to other work on shared cores than the medians.
    ratios_best = {k: gb_s(a, "min_ms") / max(gb_s(b, "min_ms") for b in bs) for k, (a, bs) in specs.items()}
    # What checking costs: the checked transfer's extra time over the same backend's unchecked one.
    checked = {row: f"{row.split('_')[0]}_unchecked" for row in by
               if row in SAME_HOST or (row.endswith("_crc32") and row.split("_")[0] in SAME_HOST)}
    checked = {row: base for row, base in checked.items() if base in by}
    checksum_cost = {row: by[row]["median_ms"] / by[base]["median_ms"] - 1 for row, base in checked.items()}
    checksum_cost_best = {row: by[row]["min_ms"] / by[base]["min_ms"] - 1 for row, base in checked.items()}
    checksum_gb_s = {row: by[row]["gb_s"] for row in by if row.startswith("sums_")}
    bounds = {"shm_vs_copy_1proc": 0.8, "tcp_vs_raw_socket": 0.9, "nixl_vs_raw_socket": 1.0,
              "auto_vs_best_same_host": 0.9, "auto_remote_vs_best_remote": 0.9}
    targets = {f"{k}>={v}": ratios[k] >= v for k, v in bounds.items() if k in ratios}
    targets.update({f"checksum_cost_{b}<=0.05": cost <= 0.05 for b, cost in checksum_cost.items()})

    print(f"\n{'method':<22}{'median ms':>10}{'GB/s':>8}{'min ms':>9}{'max ms':>9}{'cold ms':>9}{'D ms':>8}")
    for r in rows:
        d = f"{r['d_side_ms']:8.1f}" if "d_side_ms" in r else ""
        print(f"{r['method']:<22}{r['median_ms']:10.1f}{r['gb_s']:8.2f}{r['min_ms']:9.1f}{r['max_ms']:9.1f}"
              f"{r['cold_ms']:9.1f}{d}")
    print()
    print(f"{'ratio':<34}{'median':>7}{'best':>7}")
    for k, v in ratios.items():
        b = f"{ratios_best[k]:7.2f}" if k in ratios_best else ""
        print(f"{k:<34}{v:7.2f}{b}")
    print(f"\n{'checksum cost (checked vs unchecked)':<38}{'median':>7}{'best':>7}")
    for b, cost in checksum_cost.items():
        print(f"{b:<38}{cost:+7.1%}{checksum_cost_best[b]:+7.1%}")
    print(f"checked with {available()[0]} (plain rows); checksums of the moved pages alone: " +
          ", ".join(f"{row} {v:.2f} GB/s" for row, v in checksum_gb_s.items()))
    for k, v in targets.items():
        print(f"target {k:<34}{'met' if v else 'NOT met'}")

    if args.out:
        write_result(args.out, {
            "bench": "kvtransfer", "backends": sorted(chosen), "checksum": available()[0],
            "piece_bytes": checksum.PIECE_BYTES, "checksum_threads": checksum.MAX_THREADS, "layout": layout.__dict__,
            "moved_pages": args.move, "runs": len(runs),
            "payload_mb": nbytes / 1e6, "repeats": args.repeats, "threads": torch.get_num_threads(),
            "machine": {"cpu": platform.machine(), "cores": mp.cpu_count(), "torch": torch.__version__},
            "rows": rows, "ratios": ratios, "ratios_best": ratios_best, "checksum_cost": checksum_cost,
            "checksum_cost_best": checksum_cost_best, "checksum_gb_s": checksum_gb_s, "targets_met": targets,
        }, tool="tandem.bench.kvtransfer")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
