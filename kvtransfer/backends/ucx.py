"""ucx backend: page runs travel as UCX tagged messages over one UCX endpoint per peer.

Files: this one holds the sender and receiver; `ucx_plan.py` the message plan both sides derive,
`ucx_node.py` the ucxx worker, listener and endpoints, `ucx_env.py` the UCX settings.

Built on ucxx (`ucxx-cu12`), the maintained successor of ucx-py (ucx-py itself cannot be installed
here). Its Python API offers tagged, stream and active-message send/receive only, no RMA, so D takes
part in every transfer: this is a two-sided data path, like tcp, beside the control connection of
wire.py (hello, FINISH, ABORT, peer death), which it shares with the other backends.

Connection: D's receiver runs a ucxx worker (with its progress thread) and a listener (on all
interfaces: ucxx offers no bind address), and advertises the listener's port and its UCX
error-handling mode in its metadata. P's `connect` opens the control
connection (path "ucx"), then one UCX endpoint to that listener, and sends a 16-byte random token on
the endpoint's stream; its WRITE frames carry that token, so D knows which endpoint the data of a
control connection arrives on. The token's first 4 bytes prefix every tag of that endpoint's messages
(UCX matches tags per worker, not per endpoint).

A write: P sends a WRITE frame (token, first message number, destination runs), then the messages of
`plan_messages`: runs whose per-(layer, K|V) piece is at least DIRECT_MIN bytes go one piece per
message straight from P's pool into D's pool (zero copy); smaller runs are packed whole into staging
messages of at most STAGE_BYTES (one strided copy per run on each side: thousands of 6 KiB tagged
messages would cost far more than the copies). Both sides keep WINDOW messages in flight and two
staging buffers per connection, so copies overlap the transfer.

Ordering: D's reader thread handles a WRITE frame until all its messages arrived (and were unpacked),
then reads the next frame, so FINISH completes a room only after its pages landed.
Abort: once a room is done (aborted, failed) D receives its remaining messages into scratch memory and
drops staged ones; P always sends a write whole. D's `abort` returns when its reader is past the room.
Peer death: with `error_handling="peer"` UCX cancels the requests of a dead peer's endpoint; in any
mode both sides also watch the control connection while they wait and, when it is down, close the
endpoint (which cancels what is still posted on it) before failing the transfer.
"""

from __future__ import annotations

import collections
import json
import logging
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.backends.ucx_env import UcxSettings
from kvtransfer.backends.ucx_node import Endpoints, Node, cancel, wait
from kvtransfer.backends.ucx_plan import DIRECT_MIN, STAGE_BYTES, Msg, plan_messages, tag  # noqa: F401
from kvtransfer.backends.ucx_transports import Transport, check_rdma, endpoint_transports
from kvtransfer.base import PoolLayout, TransferError
from kvtransfer.protocol.liveness import connection_up
from kvtransfer.protocol.receiver import Receiver
from kvtransfer.protocol.sender import Sender
from kvtransfer.protocol.wire import Channel, Kind, ProtocolError, ReceiverMetadata, Timeouts

log = logging.getLogger(__name__)

WINDOW = 8                    # messages in flight per write, each side
SLOTS = 2                     # staging buffers per connection, each side
WRITE_HEAD = struct.Struct("<16sI4x")    # token, number of the write's first message


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(-1).view(torch.uint8).numpy()


class _Slots:
    """Staging buffers of one connection (one side), allocated on first use."""

    def __init__(self, layout: PoolLayout):
        self._layout = layout
        self._bufs: list[torch.Tensor] = []
        self._scratch = np.empty(0, dtype=np.uint8)

    def get(self, k: int, nbytes: int) -> torch.Tensor:
        while len(self._bufs) <= k:
            self._bufs.append(torch.empty(0, dtype=torch.uint8))
        if self._bufs[k].numel() < nbytes:
            self._bufs[k] = torch.empty(max(nbytes, STAGE_BYTES), dtype=torch.uint8)
        return self._bufs[k][:nbytes]

    def scratch(self, nbytes: int) -> np.ndarray:
        if len(self._scratch) < nbytes:
            self._scratch = np.empty(nbytes, dtype=np.uint8)
        return self._scratch[:nbytes]

    def runs_view(self, buf: torch.Tensor, n_pages: int, offset: int) -> torch.Tensor:
        """Pages of one run, all layers and K/V, packed at `offset` of a staging buffer."""
        lay = self._layout
        shape = (lay.num_layers, 2, n_pages, lay.page_size, lay.kv_heads, lay.head_dim)
        nbytes = n_pages * lay.num_layers * 2 * lay.page_bytes
        return buf[offset:offset + nbytes].view(lay.torch_dtype).view(shape)


# ---- P side ----------------------------------------------------------------------------------------------

class UcxPath:
    """P side: a peer's data path, used from that peer's sender thread."""

    kind = "ucx"

    def __init__(self, channel: Channel, node: Node, ep, token: bytes, src: torch.Tensor, layout: PoolLayout):
        self._ch = channel
        self._node = node
        self._ep = ep
        self._token = token
        self._src = src
        self._src_bytes = _bytes_of(src)
        self._layout = layout
        self._regions = layout.num_layers * 2
        self._slots = _Slots(layout)
        self._number = 0
        self._closed = False

    def write(self, room: int, runs: np.ndarray, stop: Callable[[], bool]) -> int:
        """Send runs `[n, 3]` (src_start, dst_start, length) whole (D discards what it no longer wants,
        so `stop` is not consulted). Returns payload bytes."""
        lay, pb = self._layout, self._layout.page_bytes
        msgs = plan_messages(runs[:, 2], pb, self._regions)
        first = self._number
        self._number = (first + len(msgs)) & 0xFFFFFFFF
        body = WRITE_HEAD.pack(self._token, first) + np.ascontiguousarray(runs[:, 1:], dtype="<i8").tobytes()
        payload = int(runs[:, 2].sum()) * self._regions * pb
        self._ch.send(Kind.WRITE, room, body, payload_len=payload)

        def up() -> bool:
            return connection_up(self._ch.sock)

        inflight: collections.deque = collections.deque()
        slot_req: list = [None] * SLOTS
        staged = 0
        try:
            for i, m in enumerate(msgs):
                while len(inflight) >= WINDOW:
                    wait(inflight.popleft()[0], up)
                if m.staged:
                    k = staged % SLOTS
                    staged += 1
                    if slot_req[k] is not None:
                        wait(slot_req[k], up)            # the slot's previous message has left
                    buf = self._slots.get(k, m.nbytes)
                    off = 0
                    for s, _, n in runs[m.run:m.end].tolist():
                        view = self._slots.runs_view(buf, n, off)
                        view.copy_(self._src[:, :, s:s + n])
                        off += view.numel() * view.element_size()
                    data = buf.numpy()
                else:
                    s, _, n = runs[m.run].tolist()
                    start = (m.region * lay.num_pages + s) * pb
                    data = self._src_bytes[start:start + n * pb]
                req = self._ep.tag_send(self._node.array(data), self._node.api.UCXXTag(tag(self._token, first + i)))
                if m.staged:
                    slot_req[k] = req
                inflight.append((req, data))
            while inflight:
                wait(inflight[0][0], up)
                inflight.popleft()
        except BaseException:
            cancel(self._ep, [req for req, _ in inflight] + [r for r in slot_req if r is not None])
            self._closed = True
            raise
        return payload

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._ep.close_blocking()
            except Exception as e:
                log.debug("ucx: closing the endpoint failed: %s", e)


@dataclass(frozen=True)
class _UcxInfo:
    """The "ucx" entry of a receiver's metadata."""
    port: int
    error_handling: str

    @classmethod
    def from_metadata(cls, metadata: bytes) -> _UcxInfo:
        try:
            d = json.loads(metadata)["ucx"]
            return cls(port=int(d["port"]), error_handling=str(d["error_handling"]))
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"receiver metadata has no usable ucx entry: {e!r}") from e


class UcxSender(Sender):
    """P side: the socket-based sender's rooms, queues and control connection, with UCX as data path."""

    def __init__(self, buffer: torch.Tensor, layout: PoolLayout, worker_id: str, *, name: str = "ucx",
                 paths: tuple[str, ...] = ("ucx",), timeouts: Timeouts = Timeouts(),
                 ucx: UcxSettings | None = None, require_rdma: bool = False, secret: bytes | None = None,
                 boot_epoch: int = 0):
        """`require_rdma`: refuse a peer unless every lane of its endpoint is an RDMA transport."""
        super().__init__(buffer, layout, worker_id, name=name, paths=paths, timeouts=timeouts, secret=secret,
                         boot_epoch=boot_epoch)
        self._node = Node(ucx or UcxSettings.from_env(), host=None)
        self.require_rdma = require_rdma
        self._transports: dict[str, list[Transport]] = {}

    def transports(self, peer_id: str) -> list[Transport]:
        return list(self._transports.get(peer_id, ()))

    def _open(self, peer_id: str, metadata: bytes, meta: ReceiverMetadata):
        info = _UcxInfo.from_metadata(metadata)
        peer, aborted = super()._open(peer_id, metadata, meta)
        ep = req = None
        try:
            api = self._node.api
            # The endpoint's error handling must match D's (UCX requires both ends to agree).
            ep = api.UCXEndpoint.create(self._node.worker, meta.host, info.port, info.error_handling == "peer")
            token = secrets.token_bytes(16)
            req = ep.stream_send(self._node.array(np.frombuffer(token, dtype=np.uint8).copy()))
            deadline = time.monotonic() + self._timeouts.connect
            while not req.completed and time.monotonic() < deadline:
                time.sleep(0.001)
            if not req.completed:
                raise TransferError(f"UCX endpoint to {meta.host}:{info.port} did not connect "
                                    f"within {self._timeouts.connect}s")
            req.check_error()
            transports = endpoint_transports(ep.handle)
            log.info("ucx: %s reached over %s", peer_id,
                     ", ".join(f"{t.name}/{t.device}" for t in transports) or "unknown transports")
            if self.require_rdma:
                check_rdma(transports, peer_id)
            self._transports[peer_id] = transports
        except Exception as e:
            if ep is not None:
                cancel(ep, [req] if req is not None else [])
            peer.ch.close()
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"cannot reach {peer_id} over UCX at {meta.host}:{info.port}: {e}") from e
        peer.path = UcxPath(peer.ch, self._node, ep, token, self._buffer, self.layout)
        return peer, aborted

    def close(self) -> None:
        super().close()
        self._node.close()


# ---- D side ----------------------------------------------------------------------------------------------

class UcxReceiver(Receiver):
    """D side: the pool in plain memory; WRITE frames announce tagged messages on the sender's endpoint."""

    def __init__(self, layout: PoolLayout, host: str, worker_id: str, *, name: str = "ucx",
                 backends: tuple[str, ...] = ("ucx",), timeouts: Timeouts = Timeouts(),
                 ucx: UcxSettings | None = None, secret: bytes | None = None):
        super().__init__(layout, host, worker_id, name=name, backends=backends, timeouts=timeouts, secret=secret)
        settings = ucx or UcxSettings.from_env()
        try:
            self._node = Node(settings, host=host)
            self._eps = Endpoints(self._node, settings.error_handling)
        except Exception:
            super().close()
            raise
        self._pool_bytes = _bytes_of(self.buffer)
        self._conn_state: dict[object, tuple[object, _Slots]] = {}   # control connection -> (endpoint, slots)
        meta = json.loads(super().metadata())
        meta["ucx"] = {"port": int(self._eps.listener.port), "error_handling": settings.error_handling}
        self._ucx_meta = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()

    def metadata(self) -> bytes:
        return self._ucx_meta

    def _on_write(self, conn, room: int, body: bytes, payload_len: int) -> None:
        if conn.path != "ucx":
            return super()._on_write(conn, room, body, payload_len)
        if len(body) < WRITE_HEAD.size or (len(body) - WRITE_HEAD.size) % 16:
            raise ProtocolError("bad ucx WRITE body")
        token, first = WRITE_HEAD.unpack_from(body)
        runs = np.frombuffer(body, dtype="<i8", offset=WRITE_HEAD.size).reshape(-1, 2)
        if (runs[:, 1] <= 0).any():
            raise ProtocolError("ucx WRITE with an empty run")   # the message plan would not match P's

        def up() -> bool:
            return connection_up(conn.ch.sock)

        state = self._conn_state.get(conn)
        if state is None:
            state = self._conn_state[conn] = (self._eps.find(token, self._timeouts.connect, up), _Slots(self.layout))
        ep, slots = state
        r, why = self._admit_write(conn, room, runs, payload_len)
        landed = 0
        try:
            landed = self._receive(ep, slots, token, first, runs, (lambda: True) if why else (lambda: r.state.done), up)
        finally:
            if not why:
                with self._lock:
                    conn.busy_room = None
                    r.bytes += landed
                    self._cond.notify_all()
        if why:
            conn.ch.try_send(Kind.ABORT, room, why.encode())

    def _receive(self, ep, slots: _Slots, token: bytes, first: int, runs: np.ndarray,
                 stop: Callable[[], bool], up: Callable[[], bool]) -> int:
        """Receive a write's messages; once `stop()` is true the rest go to scratch memory. Returns the
        bytes that landed in the pool."""
        lay, pb, node = self.layout, self.layout.page_bytes, self._node
        regions = lay.num_layers * 2
        msgs = plan_messages(runs[:, 1], pb, regions)
        posted: collections.deque = collections.deque()     # (msg, request, slot or -1, into the pool?)
        owner: list[bool] = [False] * SLOTS                 # a staging buffer holds an unprocessed message
        staged, landed, i = 0, 0, 0
        try:
            while i < len(msgs) or posted:
                while i < len(msgs) and len(posted) < WINDOW:
                    m = msgs[i]
                    k, into_pool = -1, False
                    if m.staged:
                        k = staged % SLOTS
                        if owner[k]:
                            break
                        owner[k] = True
                        staged += 1
                        target = slots.get(k, m.nbytes).numpy()
                    elif stop():
                        target = slots.scratch(m.nbytes)
                    else:
                        d, n = runs[m.run].tolist()
                        start = (m.region * lay.num_pages + d) * pb
                        target = self._pool_bytes[start:start + n * pb]
                        into_pool = True
                    req = ep.tag_recv(node.array(target), node.api.UCXXTag(tag(token, first + i)))
                    posted.append((m, req, k, into_pool))
                    i += 1
                m, req, k, into_pool = posted[0]
                wait(req, up)
                posted.popleft()
                if m.staged:
                    if not stop():
                        buf, off = slots.get(k, m.nbytes), 0
                        for d, n in runs[m.run:m.end].tolist():
                            view = slots.runs_view(buf, n, off)
                            self.buffer[:, :, d:d + n].copy_(view)
                            off += view.numel() * view.element_size()
                        landed += m.nbytes
                    owner[k] = False
                elif into_pool:
                    landed += m.nbytes
        except BaseException:
            cancel(ep, [req for _, req, _, _ in posted])
            self._eps.drop(ep)
            raise
        return landed

    def _conn_lost(self, conn, reason: str) -> None:
        super()._conn_lost(conn, reason)
        state = self._conn_state.pop(conn, None)
        if state is not None:
            self._eps.drop(state[0])
            cancel(state[0], [])

    def close(self) -> None:
        super().close()
        self._eps.close()
        self._node.close()
