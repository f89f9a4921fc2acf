"""nixl backend: P writes KV pages into D's pool with NIXL WRITEs (UCX underneath: RDMA on GPU
clusters; cma, shared memory or tcp between two processes on one host).

A data path behind kvtransfer/datapath.py: the protocol's receiver and sender (kvtransfer/protocol/)
keep the rooms, the control connection, aborts and teardown; this module only moves the bytes.

Who does what
- D (`NixlReceiverPath`) registers the receiver's pool once with its NIXL agent (DRAM; VRAM for a
  CUDA pool) and advertises the agent's metadata, the pool's base address and its UCX error-handling
  mode as the "nixl" entry of the receiver metadata that travels in the bootstrap handshake. A light
  thread progresses D's agent: UCX needs the target to progress where it takes part in a write (tcp)
  and to answer wireup.
- P (`NixlSenderPath`) registers its pool once with its own agent. Its `link` loads D's agent
  metadata, before the protocol opens the usual control connection (wire.py) with data path "nixl".
- For each queued write, P's sender thread issues NIXL WRITEs of the merged page runs (one descriptor
  per run in a page-first pool, per run per (layer, K|V) in a layer-first one, per page where a write
  of some layers of a page-first pool leaves the pages of a run apart; at most MAX_DESCS per transfer), waits for each to report DONE, then sends
  a WROTE note on the control connection. FINISH (the aux record) follows on the same connection.

Ordering: NIXL's UCX backend ends every transfer with an endpoint flush, so DONE on P means the bytes
are in D's memory; WROTE and FINISH are sent after DONE on one FIFO connection, so when FINISH makes a
room SUCCESS on D its pages hold the data. NIXL notifications are not used: the control connection
already orders completion with aborts, and D would have to poll for them.

Abort: P writes D's memory itself (one-sided, like shm), so D's `abort` sends ABORT and waits for P's
ABORT_ACK, which P's sender thread sends only after the transfer in flight is DONE. P's `abort` returns
once its sender thread is past the room (it stops between transfers, never inside one).

Peer death: the control connection's EOF fails the peer's rooms on both sides. With
`error_handling="peer"` UCX also fails a transfer in flight to a dead peer. A transfer that neither
finishes nor fails (still running after `Timeouts.send`, or ABANDON_AFTER_S after the control
connection went down) is abandoned and P drops its NIXL connection to that peer, so the transfer
cannot land later.

Memory: the pools are registered whole, once (DRAM; a CUDA tensor would be registered as VRAM, but the
socket-based receiver and sender this builds on still allocate and accept CPU pools only).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kvtransfer.backends.ucx_env import UcxSettings
from tandem.kvtransfer.base import Geometry, PoolLayout, TransferError
from tandem.kvtransfer.datapath import Link, ReceiverPath, SenderPath, flip_byte
from tandem.kvtransfer.protocol.iovec import page_iov
from tandem.kvtransfer.protocol.liveness import connection_up
from tandem.kvtransfer.protocol.wire import Kind, ReceiverMetadata, Timeouts, layers_body, wrote_body

log = logging.getLogger(__name__)

MAX_DESCS = 16384            # descriptors per NIXL transfer: bounds how long an abort waits
# D's agent progress period while it expects rooms / while idle. Where D's side takes part in a write
# (UCX over tcp) its progress rate bounds the throughput; idle, it only answers wireup and keepalive.
PROGRESS_BUSY_S = 0.0005
PROGRESS_IDLE_S = 0.005
ABANDON_AFTER_S = 2.0        # wait this long for a transfer in flight once the control connection is down
_POLL_MAX_S = 0.0002         # P polls its transfer (and so progresses it) at least this often


def _agent_name(worker_id: str, role: str) -> str:
    # Unique per process instance: a restarted worker must not collide with its predecessor's
    # metadata still loaded in its peers.
    return f"tandem-{role}-{worker_id}-{os.getpid()}-{secrets.token_hex(4)}"


def _descs(iov: np.ndarray, dev: int) -> np.ndarray:
    """NIXL's N x 3 (address, length, device) rows from N x 2 iovecs."""
    out = np.empty((len(iov), 3), dtype=np.uint64)
    out[:, :2] = iov
    out[:, 2] = dev
    return out


class _Agent:
    """One NIXL agent with the UCX backend over one registered pool tensor."""

    def __init__(self, name: str, pool: torch.Tensor, settings: UcxSettings, host: str | None,
                 busy: Callable[[], bool] | None = None):
        """`busy`: give the agent a progress thread, polling fast while `busy()` (D expects rooms)."""
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:
            raise TransferError(f"the nixl backend needs the nixl package: {e}") from e
        if not pool.is_contiguous():
            raise ValueError("the nixl backend needs a contiguous pool")
        self.name = name
        self.mem = "VRAM" if pool.is_cuda else "DRAM"
        self.dev = int(pool.device.index or 0) if pool.is_cuda else 0
        self.error_handling = settings.error_handling
        self._lock = threading.Lock()
        self._peers: dict[str, int] = {}          # remote agent -> connections using it
        self._abandoned: list[object] = []        # transfer handles NIXL could not release
        self._scratch: tuple[torch.Tensor, object] | None = None   # fault injection's buffer, registered
        self._closed = False
        params = {"ucx_error_handling_mode": settings.error_handling}
        devices = settings.devices_for(host)
        if devices:
            params["ucx_devices"] = devices
        # P's sender thread drives its own progress while it waits; the agent's own progress thread
        # would spin a core. STRICT: several threads (connect, sender threads, close) use the agent.
        cfg = nixl_agent_config(enable_prog_thread=False, backends=[],
                                sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            with settings.process_env():
                self._agent = nixl_agent(name, cfg)
                self._agent.create_backend("UCX", params)
            nbytes = pool.numel() * pool.element_size()
            self._reg = self._agent.register_memory([(pool.data_ptr(), nbytes, self.dev, "")], self.mem)
            self.metadata = bytes(self._agent.get_agent_metadata())
        except Exception as e:
            raise TransferError(f"cannot set up NIXL agent {name} (UCX {params}): {e}") from e
        self._stop = threading.Event()
        self._thread = None
        if busy is not None:
            self._thread = threading.Thread(target=self._progress_loop, args=(busy,), daemon=True,
                                            name=f"nixl-progress-{name}")
            self._thread.start()

    def _progress_loop(self, busy: Callable[[], bool]) -> None:
        while not self._stop.wait(PROGRESS_BUSY_S if busy() else PROGRESS_IDLE_S):
            try:
                self._agent.get_new_notifs()      # progresses the UCX worker; notifications are unused
            except Exception:
                log.exception("NIXL agent %s: progress failed", self.name)
                self._stop.wait(1.0)

    def add_peer(self, metadata: bytes, name: str) -> None:
        with self._lock:
            if self._closed:
                raise TransferError("NIXL agent is closed")
            if name in self._peers:
                self._peers[name] += 1
                return
            try:
                loaded = self._agent.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(f"cannot load NIXL metadata of {name}: {e}") from e
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != name:
                self._remove(loaded)
                raise TransferError(f"NIXL metadata is for agent {loaded!r}, not {name!r}")
            self._peers[name] = 1

    def remove_peer(self, name: str, force: bool = False) -> None:
        with self._lock:
            n = self._peers.get(name, 0) - 1
            if n > 0 and not force:
                self._peers[name] = n
                return
            if self._peers.pop(name, None) is not None and not self._closed:
                self._remove(name)

    def _remove(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)     # also disconnects UCX from that peer
        except Exception as e:
            log.warning("NIXL agent %s: cannot remove peer %s: %s", self.name, name, e)

    def write(self, local: np.ndarray, remote: np.ndarray, peer: str, remote_mem: str,
              up: Callable[[], bool], timeout: float) -> None:
        """WRITE local[i] -> remote[i] (rows of address, length, device); returns once DONE, i.e. the
        bytes are in the peer's memory. TransferError if it fails or is abandoned."""
        a = self._agent
        try:
            handle = a.initialize_xfer("WRITE", a.get_xfer_descs(local, self.mem),
                                       a.get_xfer_descs(remote, remote_mem), peer)
        except Exception as e:
            raise TransferError(f"NIXL write to {peer} could not be set up: {e}") from e
        deadline = time.monotonic() + timeout
        down_since = None
        delay = 20e-6
        try:
            state = a.transfer(handle)
            while state == "PROC":
                now = time.monotonic()
                if down_since is None and not up():
                    down_since = now
                if now > deadline or (down_since is not None and now - down_since > ABANDON_AFTER_S):
                    state = "ABANDONED"
                    break
                time.sleep(delay)
                delay = min(2 * delay, _POLL_MAX_S)
                state = a.check_xfer_state(handle)
        except Exception as e:
            state = f"ERR ({e})"
        finally:
            try:
                handle.release()
            except Exception:
                # NIXL could not cancel it: keep the handle alive (its finalizer would retry); the peer
                # is cut off below so the write cannot land later.
                self._abandoned.append(handle)
                if state != "DONE":
                    state = "ABANDONED"
        if state == "DONE":
            return
        if state == "ABANDONED":
            log.warning("NIXL write to %s abandoned (still in progress); dropping the NIXL connection", peer)
            self.remove_peer(peer, force=True)
        raise TransferError(f"NIXL write to {peer}: {state}")

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least `nbytes` registered with the agent (fault injection writes from it);
        registered once, on first use."""
        with self._lock:
            if self._scratch is None or self._scratch[0].numel() < nbytes:
                buf = torch.empty(nbytes, dtype=torch.uint8)
                try:
                    reg = self._agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], "DRAM")
                except Exception as e:
                    raise TransferError(f"NIXL agent {self.name}: cannot register a scratch buffer: {e}") from e
                if self._scratch is not None:
                    self._agent.deregister_memory(self._scratch[1])
                self._scratch = (buf, reg)
            return self._scratch[0]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._peers.clear()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for reg in (self._reg, *(self._scratch[1:] if self._scratch is not None else ())):
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.warning("NIXL agent %s: deregister failed: %s", self.name, e)


@dataclass(frozen=True)
class _NixlInfo:
    """The "nixl" entry of a receiver's metadata."""
    agent: str
    md: bytes
    base: int
    mem: str
    dev: int
    error_handling: str

    def to_json(self) -> dict:
        return {"agent": self.agent, "md": base64.b64encode(self.md).decode(), "base": self.base,
                "mem": self.mem, "dev": self.dev, "error_handling": self.error_handling}

    @classmethod
    def from_metadata(cls, meta: ReceiverMetadata) -> _NixlInfo:
        try:
            d = meta.entries["nixl"]
            return cls(agent=str(d["agent"]), md=base64.b64decode(d["md"], validate=True), base=int(d["base"]),
                       mem=str(d["mem"]), dev=int(d["dev"]), error_handling=str(d["error_handling"]))
        except (ValueError, KeyError, TypeError, binascii.Error) as e:
            raise TransferError(f"receiver metadata has no usable nixl entry: {e!r}") from e


class NixlReceiverPath(ReceiverPath):
    """D side: the receiver's pool, registered with a NIXL agent that P's agent writes into."""

    kind = "nixl"
    one_sided = True            # NIXL WRITEs land without us: aborts wait for P's ack
    layer_writes = True         # WROTE_LAYERS notes (a few layers of the pages at a time)

    def __init__(self, layout: PoolLayout, host: str, worker_id: str, *, ucx: UcxSettings | None = None):
        self._host = host
        self._worker_id = worker_id
        self._settings = ucx
        self._agent: _Agent | None = None

    def attach(self, pool: torch.Tensor, busy: Callable[[], bool]) -> dict:
        self._agent = _Agent(_agent_name(self._worker_id, "rx"), pool, self._settings or UcxSettings.from_env(),
                             host=self._host, busy=busy)
        return _NixlInfo(agent=self._agent.name, md=self._agent.metadata, base=pool.data_ptr(), mem=self._agent.mem,
                         dev=self._agent.dev, error_handling=self._agent.error_handling).to_json()

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()


class NixlSenderPath(SenderPath):
    """P side: one NIXL agent over P's pool; a peer's link holds that peer's agent metadata loaded."""

    kind = "nixl"

    def __init__(self, layout: PoolLayout, worker_id: str, *, ucx: UcxSettings | None = None,
                 timeouts: Timeouts = Timeouts()):
        self._layout = layout
        self._worker_id = worker_id
        self._settings = ucx
        self._timeouts = timeouts
        self._agent: _Agent | None = None
        self._src: torch.Tensor | None = None

    def attach(self, pool: torch.Tensor) -> None:
        self._src = pool
        self._agent = _Agent(_agent_name(self._worker_id, "tx"), pool, self._settings or UcxSettings.from_env(),
                             host=None)

    def link(self, peer_id: str, meta: ReceiverMetadata) -> NixlLink:
        info = _NixlInfo.from_metadata(meta)
        if info.error_handling != self._agent.error_handling:
            raise TransferError(f"UCX error handling differs: {peer_id} uses {info.error_handling!r}, "
                                f"this sender {self._agent.error_handling!r} (set TANDEM_UCX_ERROR_HANDLING alike)")
        self._agent.add_peer(info.md, info.agent)
        return NixlLink(self._agent, info, self._src, self._layout, meta.layout, self._timeouts)

    def close(self) -> None:
        if self._agent is not None:
            self._agent.close()


class NixlLink(Link):
    """P side: NIXL WRITEs of a peer's page runs, then a WROTE note."""

    kind = "nixl"
    layer_writes = True

    def __init__(self, agent: _Agent, info: _NixlInfo, src: torch.Tensor, layout: PoolLayout,
                 dst_layout: PoolLayout, timeouts: Timeouts):
        self._agent = agent
        self._info = info
        self._src = src
        self._src_base = src.data_ptr()
        self._layout, self._dst_layout = layout, dst_layout
        self._timeouts = timeouts
        self._closed = False

    def write(self, room: int, runs: np.ndarray, stop: Callable[[], bool], corrupt: bool = False,
              layers: tuple[int, int] | None = None) -> int:
        """WRITE runs `[n, 3]` (src_start, dst_start, length), of `layers` (first, end) only if given,
        stopping between transfers once `stop()`; then tell D with a WROTE (WROTE_LAYERS) note. Returns
        the bytes written."""
        started = time.monotonic()
        src_geometry, dst_geometry = self._layout.geometry(layers), self._dst_layout.geometry(layers)
        # Descriptors per run: one per region, or one per page and region where a run's pages are not
        # one range (some layers of a page-first pool).
        descs = src_geometry.regions * (1 if src_geometry.runs_contiguous else runs[:, 2])
        pages = copied = 0
        for lo, hi in _batches(np.broadcast_to(descs, len(runs)), MAX_DESCS):
            if stop():
                break
            chunk = runs[lo:hi]
            local = page_iov(self._src_base, src_geometry, chunk[:, 0], chunk[:, 2])
            remote = page_iov(self._info.base, dst_geometry, chunk[:, 1], chunk[:, 2])
            self._agent.write(_descs(local, self._agent.dev), _descs(remote, self._info.dev), self._info.agent,
                              self._info.mem, lambda: connection_up(self.ch.sock), self._timeouts.send)
            pages += int(chunk[:, 2].sum())
            copied = hi
        if corrupt and copied:
            self._overwrite_flipped(runs[0], src_geometry, dst_geometry)
        nbytes = pages * src_geometry.page_bytes
        # Same host: D times the room from here (CLOCK_MONOTONIC is shared); elsewhere D uses its own clock.
        note = wrote_body(started, runs[:copied])
        if layers:
            self.ch.send(Kind.WROTE_LAYERS, room, layers_body(layers) + note, payload_len=nbytes)
        else:
            self.ch.send(Kind.WROTE, room, note, payload_len=nbytes)
        return nbytes

    def _overwrite_flipped(self, run: np.ndarray, src: Geometry, dst: Geometry) -> None:
        """Fault injection: once the write landed, WRITE the piece of the run's first page in the write's
        first region again, from a registered copy with a byte flipped (NIXL writes only from registered
        memory)."""
        n = src.piece
        start = src.offset + int(run[0]) * src.page_stride
        scratch = self._agent.scratch(n)
        scratch[:n].copy_(self._src.view(-1).view(torch.uint8)[start:start + n])
        flip_byte(scratch[:n].numpy())
        local = np.array([[scratch.data_ptr(), n]], dtype=np.uint64)
        remote = np.array([[self._info.base + dst.offset + int(run[1]) * dst.page_stride, n]], dtype=np.uint64)
        self._agent.write(_descs(local, 0), _descs(remote, self._info.dev), self._info.agent, self._info.mem,
                          lambda: connection_up(self.ch.sock), self._timeouts.send)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._agent.remove_peer(self._info.agent)


def _batches(sizes: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of consecutive items whose sizes add up to at most `limit` (one item at least)."""
    out, lo, total = [], 0, 0
    for i, n in enumerate(sizes.tolist()):
        if i > lo and total + n > limit:
            out.append((lo, i))
            lo, total = i, 0
        total += n
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out
