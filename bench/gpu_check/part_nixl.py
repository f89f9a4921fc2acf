"""Part `nixl`: KV pages written from one process's device memory into another's with NIXL.

This process plays P and bench/gpu_check/nixl_peer.py (a second process) plays D, each with its own
pool tensor on the GPU registered whole as VRAM with its own NIXL agent — the nixl backend's agent
class (kvtransfer/backends/nixl.py), UCX underneath choosing its transports (cuda_ipc between two
processes on one GPU, when it works). P writes scattered page runs of every (layer, K|V) region,
as the backend's sender does, times the writes, and D proves the bytes: a position-weighted
checksum of its destination pages must equal P's of the source pages, and every other page of D's
pool must still be zero. Run once with UCX error handling "peer" (the workers' default) and once
with "none"; both must work.

The socket-based sender and receiver the nixl backend builds on still take CPU pools only (see
kvtransfer/backends/nixl.py), so this drives the agents directly: it checks that the NIXL/UCX
stack moves device memory on this machine; part `disagg` checks the workers.
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from tandem.bench.gpu_check.nixl_peer import DTYPES, PREFIX, digest
from tandem.bench.gpu_check.report import CheckFailed, main_of, require

GPU_SHAPE = (4, 2, 2048, 16, 8, 128)       # 32 KiB pages, 512 MiB per pool (bf16)
CPU_SHAPE = (2, 2, 256, 16, 2, 64)         # the CPU exercise (DRAM): 8 KiB pages in fp32, 8 MiB
REPEATS = 3


def page_runs(num_pages: int, seed: int = 0, max_run: int = 16) -> np.ndarray:
    """`[n, 3]` (src_start, dst_start, length): runs covering about half the pool, laid out in a
    different order and with different gaps on each side, never overlapping."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while True:
        n = int(rng.integers(1, max_run + 1))
        if total + n > num_pages // 2:
            break
        lengths.append(n)
        total += n

    def lay_out(order: np.ndarray) -> np.ndarray:
        spare = num_pages - total
        gaps = rng.multinomial(spare, np.ones(len(order) + 1) / (len(order) + 1))[:len(order)]
        starts = np.empty(len(order), dtype=np.int64)
        pos = 0
        for i, k in enumerate(order):
            pos += gaps[i]
            starts[k] = pos
            pos += lengths[k]
        return starts

    lengths_arr = np.array(lengths, dtype=np.int64)
    src = lay_out(np.arange(len(lengths)))
    dst = lay_out(rng.permutation(len(lengths)))
    return np.stack([src, dst, lengths_arr], axis=1)


def expand(runs: np.ndarray, column: int) -> list[int]:
    return [int(s) + i for s, n in zip(runs[:, column], runs[:, 2], strict=True) for i in range(int(n))]


class Peer:
    """D: the nixl_peer process and its line protocol."""

    def __init__(self, device: str, shape: tuple[int, ...], dtype: str, error_handling: str, timeout_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "tandem.bench.gpu_check.nixl_peer", "--device", device, "--shape",
             ",".join(map(str, shape)), "--dtype", dtype, "--error-handling", error_handling],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.timeout_s = timeout_s
        self.info = self.read()

    def read(self) -> dict:
        deadline = time.monotonic() + self.timeout_s
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
            print(f"peer: {line.rstrip()}", flush=True)
            if time.monotonic() > deadline:
                break
        raise CheckFailed(f"the receiving process ended (exit {self.proc.poll()}) without answering")

    def ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def transfer(device: str, shape: tuple[int, ...], dtype: str, error_handling: str, timeout_s: float) -> dict:
    from tandem.kvtransfer.backends.nixl import MAX_DESCS, _Agent, _agent_name, _descs
    from tandem.kvtransfer.backends.ucx_env import UcxSettings
    from tandem.kvtransfer.base import Geometry
    from tandem.kvtransfer.protocol.iovec import page_iov

    layers, _, pages = shape[:3]
    g = torch.Generator(device=device).manual_seed(7)
    src = torch.randn(shape, generator=g, device=device).to(DTYPES[dtype])
    page_bytes = src[0, 0, 0].numel() * src.element_size()
    runs = page_runs(pages)
    # the pools here are layer-first: a run is one piece per (layer, K|V) region
    geometry = Geometry(offset=0, regions=layers * 2, region_stride=pages * page_bytes, piece=page_bytes,
                        page_stride=page_bytes)
    out = {"error_handling": error_handling, "pool_mib": src.numel() * src.element_size() >> 20,
           "page_bytes": page_bytes, "runs": len(runs), "pages": int(runs[:, 2].sum())}
    peer = Peer(device, shape, dtype, error_handling, timeout_s)
    agent = _Agent(_agent_name("gpu-check", "tx"), src, UcxSettings.from_env(error_handling=error_handling), host=None)
    try:
        info = peer.info
        out["mem"] = [agent.mem, info["mem"]]
        if device == "cuda":
            require(agent.mem == "VRAM" and info["mem"] == "VRAM", f"pools registered as {out['mem']}, not VRAM")
        agent.add_peer(base64.b64decode(info["md"]), info["agent"])
        step = max(1, MAX_DESCS // geometry.regions)

        def write_all() -> float:
            t0 = time.perf_counter()
            for i in range(0, len(runs), step):
                chunk = runs[i:i + step]
                local = page_iov(src.data_ptr(), geometry, chunk[:, 0], chunk[:, 2])
                remote = page_iov(info["base"], geometry, chunk[:, 1], chunk[:, 2])
                agent.write(_descs(local, agent.dev), _descs(remote, info["dev"]), info["agent"], info["mem"],
                            lambda: peer.proc.poll() is None, timeout=timeout_s)
            return time.perf_counter() - t0

        nbytes = out["pages"] * geometry.page_bytes
        out["bytes"] = nbytes
        out["first_write_s"] = round(write_all(), 4)          # includes UCX wireup and memory mapping
        times = [write_all() for _ in range(REPEATS)]
        out["write_s"] = [round(t, 4) for t in times]
        out["gbps"] = round(nbytes / statistics.median(times) / 1e9, 2)
        out["descriptors"] = len(runs) * geometry.regions
        if device == "cuda":
            torch.cuda.synchronize()
        theirs = peer.ask({"cmd": "digest", "pages": expand(runs, 1)})
        ours = digest(src, expand(runs, 0))
        out["verified"] = theirs["digest"] == ours and theirs["untouched_nonzero"] == 0
        require(theirs["digest"] == ours, "the destination pages do not hold the source pages' bytes")
        require(theirs["untouched_nonzero"] == 0,
                f"{theirs['untouched_nonzero']} elements outside the destination pages were written")
        agent.remove_peer(info["agent"])
    finally:
        agent.close()
        peer.close()
    return out


def run(report, args) -> None:
    device = args.device
    if device == "cuda":
        require(torch.cuda.is_available(), "torch sees no CUDA device")
    shape = GPU_SHAPE if device == "cuda" else CPU_SHAPE
    dtype = "bfloat16" if device == "cuda" else "float32"
    os.environ.setdefault("UCX_PROTO_INFO", "y")     # UCX prints the transports it picks (into the log)
    import importlib.metadata

    import nixl

    variant = getattr(getattr(nixl, "_pkg", None), "__name__", None)     # which nixl_cuXX the meta package loaded
    report.details.update(nixl=importlib.metadata.version("nixl"), nixl_variant=variant,
                          ucx_tls=os.environ.get("UCX_TLS", "(unset: UCX chooses)"), runs=[])
    report.save()
    errors = []
    for mode in ("peer", "none"):
        try:
            row = transfer(device, shape, dtype, mode, timeout_s=max(10.0, report.left_s() / 3))
        except Exception as e:
            row = {"error_handling": mode, "error": f"{type(e).__name__}: {e}"}
            errors.append(f"error handling {mode!r}: {row['error']}")
        report.details["runs"].append(row)
        print(f"nixl {device}: {row}", flush=True)
        report.save()
    require(not errors, "; ".join(errors))


def add_args(p) -> None:
    p.add_argument("--device", default="cuda", help="cuda (VRAM); cpu exercises the part in DRAM")


if __name__ == "__main__":
    main_of(run, add_args)
