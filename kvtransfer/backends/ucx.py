"""ucx backend: page runs travel as UCX tagged messages over one UCX endpoint per peer.

A data path behind kvtransfer/datapath.py: the protocol's receiver and sender (kvtransfer/protocol/)
keep the rooms, the control connection, aborts and teardown; this module only moves the bytes.
Files: this one holds both sides of the data path; `ucx_plan.py` the message plan both sides derive,
`ucx_node.py` the ucxx worker, listener and endpoints, `ucx_env.py` the UCX settings.

Built on ucxx (`ucxx-cu12`), the maintained successor of ucx-py (ucx-py itself cannot be installed
here). Its Python API offers tagged, stream and active-message send/receive only, no RMA, so D takes
part in every transfer: this is a two-sided data path, like tcp, beside the control connection of
wire.py (hello, FINISH, ABORT, peer death), which it shares with the other backends.

Connection: D's path runs a ucxx worker (with its progress thread) and a listener (on all
interfaces: ucxx offers no bind address), and advertises the listener's port and its UCX
error-handling mode as the "ucx" entry of the receiver metadata. Once P's `connect` has opened the
control connection (path "ucx"), the link opens one UCX endpoint to that listener, and sends a 16-byte random token on
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
import logging
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.kvtransfer.backends.ucx_env import UcxSettings
from tandem.kvtransfer.backends.ucx_node import Endpoints, Node, cancel, wait
from tandem.kvtransfer.backends.ucx_plan import DIRECT_MIN, STAGE_BYTES, Msg, plan_messages, tag  # noqa: F401
from tandem.kvtransfer.backends.ucx_transports import Transport, check_rdma, endpoint_transports
from tandem.kvtransfer.base import PoolLayout, TransferError
from tandem.kvtransfer.datapath import Incoming, Link, ReceiverPath, SenderPath, flip_byte
from tandem.kvtransfer.protocol.liveness import connection_up
from tandem.kvtransfer.protocol.wire import Channel, Kind, ProtocolError, ReceiverMetadata, Timeouts

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
        """Pages of one run, all layers and K/V, packed page by page at `offset` of a staging buffer
        (`[n_pages, num_layers, 2, ...]`: what `PoolLayout.by_page` gives of a pool, either layout)."""
        lay = self._layout
        shape = (n_pages, lay.num_layers, 2, lay.page_size, lay.kv_heads, lay.head_dim)
        nbytes = n_pages * lay.geometry().page_bytes
        return buf[offset:offset + nbytes].view(lay.torch_dtype).view(shape)


# ---- P side ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _UcxInfo:
    """The "ucx" entry of a receiver's metadata."""
    port: int
    error_handling: str

    @classmethod
    def from_metadata(cls, meta: ReceiverMetadata) -> _UcxInfo:
        try:
            d = meta.entries["ucx"]
            return cls(port=int(d["port"]), error_handling=str(d["error_handling"]))
        except (ValueError, KeyError, TypeError) as e:
            raise TransferError(f"receiver metadata has no usable ucx entry: {e!r}") from e


class UcxSenderPath(SenderPath):
    """P side: one ucxx worker for every peer's endpoint."""

    kind = "ucx"

    def __init__(self, layout: PoolLayout, worker_id: str, *, ucx: UcxSettings | None = None,
                 require_rdma: bool = False, timeouts: Timeouts = Timeouts()):
        """`require_rdma`: refuse a peer unless every lane of its endpoint is an RDMA transport."""
        self._layout = layout
        self._settings = ucx
        self.require_rdma = require_rdma
        self._timeouts = timeouts
        self._node: Node | None = None
        self._src: torch.Tensor | None = None

    def attach(self, pool: torch.Tensor) -> None:
        self._src = pool
        self._node = Node(self._settings or UcxSettings.from_env(), host=None)

    def link(self, peer_id: str, meta: ReceiverMetadata) -> UcxLink:
        return UcxLink(self._node, peer_id, meta.host, _UcxInfo.from_metadata(meta), self._src, self._layout,
                       self._timeouts, self.require_rdma)

    def close(self) -> None:
        if self._node is not None:
            self._node.close()


class UcxLink(Link):
    """P side: a peer's endpoint, opened after the handshake; used from that peer's sender thread."""

    kind = "ucx"

    def __init__(self, node: Node, peer_id: str, host: str, info: _UcxInfo, src: torch.Tensor, layout: PoolLayout,
                 timeouts: Timeouts, require_rdma: bool):
        self._node = node
        self._peer_id = peer_id
        self._host = host
        self._info = info
        self._timeouts = timeouts
        self._require_rdma = require_rdma
        self._ep = None
        self._token = b""
        self._transports: list[Transport] = []
        self._src = src
        self._src_bytes = _bytes_of(src)
        self._layout = layout
        self._geometry = layout.geometry()
        self._by_page = layout.by_page(src)
        self._slots = _Slots(layout)
        self._number = 0
        self._closed = False

    def start(self, ch: Channel) -> None:
        """One UCX endpoint to the peer's listener, announced by a random token on its stream."""
        self.ch = ch
        info, peer_id, ep, req = self._info, self._peer_id, None, None
        try:
            api = self._node.api
            # The endpoint's error handling must match D's (UCX requires both ends to agree).
            ep = api.UCXEndpoint.create(self._node.worker, self._host, info.port, info.error_handling == "peer")
            token = secrets.token_bytes(16)
            # The request does not keep its buffer alive: `sent` must outlive it (a freed buffer was
            # reused by the next small allocation before UCX read it, and D saw another token).
            sent = np.frombuffer(token, dtype=np.uint8).copy()
            req = ep.stream_send(self._node.array(sent))
            deadline = time.monotonic() + self._timeouts.connect
            while not req.completed and time.monotonic() < deadline:
                time.sleep(0.001)
            if not req.completed:
                raise TransferError(f"UCX endpoint to {self._host}:{info.port} did not connect "
                                    f"within {self._timeouts.connect}s")
            req.check_error()
            transports = endpoint_transports(ep.handle)
            log.info("ucx: %s reached over %s", peer_id,
                     ", ".join(f"{t.name}/{t.device}" for t in transports) or "unknown transports")
            if self._require_rdma:
                check_rdma(transports, peer_id)
        except Exception as e:
            self._closed = True
            if ep is not None:
                cancel(ep, [req] if req is not None else [])
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"cannot reach {peer_id} over UCX at {self._host}:{info.port}: {e}") from e
        self._ep, self._token, self._transports = ep, token, transports

    def transports(self) -> list[Transport]:
        return list(self._transports)

    def write(self, room: int, runs: np.ndarray, stop: Callable[[], bool], corrupt: bool = False) -> int:
        """Send runs `[n, 3]` (src_start, dst_start, length) whole (D discards what it no longer wants,
        so `stop` is not consulted). Returns payload bytes."""
        g = self._geometry
        msgs = plan_messages(runs[:, 2], g.piece, g.regions)
        first = self._number
        self._number = (first + len(msgs)) & 0xFFFFFFFF
        body = WRITE_HEAD.pack(self._token, first) + np.ascontiguousarray(runs[:, 1:], dtype="<i8").tobytes()
        payload = int(runs[:, 2].sum()) * g.page_bytes
        self.ch.send(Kind.WRITE, room, body, payload_len=payload)

        def up() -> bool:
            return connection_up(self.ch.sock)

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
                        view.copy_(self._by_page[s:s + n])
                        off += view.numel() * view.element_size()
                    data = buf.numpy()
                else:
                    s, _, n = runs[m.run].tolist()
                    start = g.offset + m.region * g.region_stride + s * g.page_stride
                    data = self._src_bytes[start:start + n * g.piece]
                if corrupt and i == 0:       # the first message goes out from a copy with a byte flipped
                    data = data.copy()
                    flip_byte(data)
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
            if self._ep is None:
                return
            try:
                self._ep.close_blocking()
            except Exception as e:
                log.debug("ucx: closing the endpoint failed: %s", e)


# ---- D side ----------------------------------------------------------------------------------------------

class UcxReceiverPath(ReceiverPath):
    """D side: WRITE frames announce tagged messages on the endpoint the sender's token names."""

    kind = "ucx"

    def __init__(self, layout: PoolLayout, host: str, worker_id: str, *, ucx: UcxSettings | None = None,
                 timeouts: Timeouts = Timeouts()):
        self._layout = layout
        self._host = host
        self._settings = ucx or UcxSettings.from_env()
        self._timeouts = timeouts
        self._node: Node | None = None
        self._eps: Endpoints | None = None
        self._conn_state: dict[Channel, tuple[object, _Slots]] = {}   # control channel -> (endpoint, slots)

    def attach(self, pool: torch.Tensor, busy: Callable[[], bool]) -> dict:
        self._pool = pool
        self._pool_bytes = _bytes_of(pool)
        self._node = Node(self._settings, host=self._host)
        self._eps = Endpoints(self._node, self._settings.error_handling)
        return {"port": int(self._eps.listener.port), "error_handling": self._settings.error_handling}

    def incoming(self, ch: Channel, body: bytes, payload_len: int) -> Incoming:
        if len(body) < WRITE_HEAD.size or (len(body) - WRITE_HEAD.size) % 16:
            raise ProtocolError("bad ucx WRITE body")
        token, first = WRITE_HEAD.unpack_from(body)
        runs = np.frombuffer(body, dtype="<i8", offset=WRITE_HEAD.size).reshape(-1, 2)
        if (runs[:, 1] <= 0).any():
            raise ProtocolError("ucx WRITE with an empty run")   # the message plan would not match P's

        def up() -> bool:
            return connection_up(ch.sock)

        state = self._conn_state.get(ch)
        if state is None:
            state = self._conn_state[ch] = (self._eps.find(token, self._timeouts.connect, up), _Slots(self._layout))
        ep, slots = state

        def receive(stop: Callable[[], bool]) -> int:
            return self._receive(ep, slots, token, first, runs, stop, up)

        return Incoming(runs, receive, lambda: receive(lambda: True))

    def _receive(self, ep, slots: _Slots, token: bytes, first: int, runs: np.ndarray,
                 stop: Callable[[], bool], up: Callable[[], bool]) -> int:
        """Receive a write's messages; once `stop()` is true the rest go to scratch memory. Returns the
        bytes that landed in the pool."""
        g, node = self._layout.geometry(), self._node
        by_page = self._layout.by_page(self._pool)
        msgs = plan_messages(runs[:, 1], g.piece, g.regions)
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
                        start = g.offset + m.region * g.region_stride + d * g.page_stride
                        target = self._pool_bytes[start:start + n * g.piece]
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
                            by_page[d:d + n].copy_(view)
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

    def conn_lost(self, ch: Channel) -> None:
        state = self._conn_state.pop(ch, None)
        if state is not None:
            self._eps.drop(state[0])
            cancel(state[0], [])

    def close(self) -> None:
        if self._eps is not None:
            self._eps.close()
        if self._node is not None:
            self._node.close()
