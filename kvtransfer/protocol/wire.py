"""The control channel shared by every socket-based backend: frames, receiver metadata, hello.

One TCP connection per (sender, receiver) pair carries everything in FIFO order. A frame is a
24-byte little-endian header `<B3xIQQ` = (kind, body_len, room, payload_len), then `body_len` bytes
of body, then (WRITE only) `payload_len` bytes of page data:

| kind      | dir  | body                                   | payload                          |
|-----------|------|----------------------------------------|----------------------------------|
| CHALLENGE | D->P | 32 random bytes (first frame)          | -                                |
| HELLO     | P->D | JSON {version, worker_id, epoch, layout, path, checksum, nonce, proof} | - |
| HELLO_ACK | D->P | JSON {ok, error, aborted: [room...], proof} | -                           |
| WRITE     | P->D | int64 [n_runs, 2] (dst_start, length)  | pages, (layer, K|V)-major, run-minor |
| WRITE_LAYERS | P->D | `<II` first layer, layer count; then the WRITE body | the pages of those layers' regions only, as WRITE |
| WROTE_LAYERS | P->D | `<II` first layer, layer count; then the WROTE body (a one-sided path copied those layers only) | - |
| WROTE     | P->D | `<d` monotonic time the copy began, then int64 (dst_start, length) runs (one-sided paths: P already copied payload_len bytes into those pages) | - |
| FINISH    | P->D | the room's aux record                  | -                                |
| DONE      | D->P | - (D marked the room SUCCESS)          | -                                |
| ABORT     | both | utf-8 reason                           | -                                |
| ABORT_ACK | P->D | - (P will not touch the room's pages again)                            | - |
| PROGRESS  | P->D | `<QQQd` tokens done, tokens of the prompt, tokens queued ahead, expected_s (base.Progress) | - |
| SUMS      | P->D | int64 [n_runs, 2] (dst_start, length) of the write just before it, `<Q` its checksum | - |

PROGRESS reports a room P is still computing (so D's transfer timeout can follow P's pace); it is
sent only to receivers whose metadata has `"progress": true`. It needs no version bump: a receiver
from before it never advertises the flag (an unknown frame kind would drop the connection), and a
sender from before it never sends one, so D falls back to its fixed timeout.

SUMS (protocol/checksum.py) follows each write of a room, on every data path: the checksum of its
pages over what P read from its pool, which D checks against its own pool before the room may
succeed. The same kind of capability: a receiver that checks advertises the algorithms it has
(`"checksums": ["xxh3", "crc32"]`, preferred first), and only a sender that names one of them in its
hello (`"checksum": "xxh3"`: the first of them it has too) sends SUMS and has its rooms checked. Old
peers stay explicit: a sender from before it sends none, and D completes its rooms unchecked (warning
once per connection); a receiver from before it advertises none, and P sends none (a warning too).

WRITE_LAYERS (two-sided paths) and WROTE_LAYERS (one-sided) let P send a room's pages a few layers at a time, as soon as its forward pass wrote
them (streaming during the prefill, services/prefill/worker.py), instead of all layers after it. The
same kind of capability again: a receiver lists the data paths it takes them on (`"layer_writes":
["tcp"]`; absent: none) and a sender sends them only to such a receiver over such a path. Integrity
and accounting are per (page, layer): the SUMS after a WRITE_LAYERS covers that write's layers.

Receiver metadata (what `KVReceiver.metadata()` returns) is compact UTF-8 JSON with sorted keys:
`{"version": 2, "worker_id": str, "backends": ["shm", "tcp"], "host": str, "port": int,
  "layout": {num_layers, num_pages, page_size, kv_heads, head_dim, dtype, kv_layout}, "progress": bool,
  "checksums": [str], "layer_writes": [str], "shm": null | {...}}` and one more entry for each data path that advertises
one, under the path's name (what its `ReceiverPath.attach` returns; the protocol only carries it):
"shm" (protocol/shm.py: path, size, offset, nonce, hostname; always written, null when the receiver
offers no shm, as every v2 receiver did), "nixl" and "ucx" (kvtransfer/backends/). "progress" absent:
false; "checksums" absent: the receiver checks no checksums (written only when it does).
`host:port` is the control socket (always present: even shm sends its control frames over it);
`backends` lists the data paths the receiver accepts, in its order of preference.
The opening exchange (CHALLENGE, HELLO, HELLO_ACK) and its proof of the shared secret: handshake.py.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import math
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tandem.kvtransfer.base import PoolLayout, Progress, TransferError

log = logging.getLogger(__name__)

VERSION = 2
HEADER = struct.Struct("<B3xIQQ")
WROTE_BODY = struct.Struct("<d")       # followed by the runs, as a WRITE body
PROGRESS_BODY = struct.Struct("<QQQd")  # tokens done, tokens of the prompt, tokens queued ahead, expected_s
LAYERS_BODY = struct.Struct("<II")      # WRITE_LAYERS: first layer, layer count; followed by a WRITE body
MAX_BODY = 64 << 20


class Kind(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    WRITE = 3
    WROTE = 4
    FINISH = 5
    DONE = 6
    ABORT = 7
    ABORT_ACK = 8
    CHALLENGE = 9
    PROGRESS = 10
    SUMS = 11
    WRITE_LAYERS = 12
    WROTE_LAYERS = 13


class ProtocolError(TransferError):
    """The peer sent something this side cannot parse; the connection is dropped."""


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0        # TCP connect + hello round trip
    abort: float = 5.0          # abort waits this long for an in-flight write, then drops the connection
    send: float = 30.0          # a send that makes no progress this long fails the connection (SO_SNDTIMEO)
    keepalive_idle: int = 3     # TCP keepalive: an idle link to a silent host fails after idle + intvl * cnt
    keepalive_intvl: int = 2    # seconds (9 s, within services/common/keepalive.py's 10 s bound) ...
    keepalive_cnt: int = 3
    user_timeout: float = 9.0   # ... and one with data in flight once nothing was acknowledged this long
                                # (TCP_USER_TIMEOUT; a slow link acknowledges all the time, so it stays up)


_CORE_KEYS = frozenset({"version", "worker_id", "backends", "host", "port", "layout", "progress", "checksums",
                        "layer_writes"})


@dataclass(frozen=True)
class ReceiverMetadata:
    worker_id: str
    layout: PoolLayout
    host: str
    port: int
    backends: tuple[str, ...]
    progress: bool = False              # takes PROGRESS frames
    checksums: tuple[str, ...] = ()     # checks SUMS frames of these algorithms, preferred first
    layer_writes: tuple[str, ...] = ()  # takes WRITE_LAYERS frames over these data paths
    entries: Mapping[str, dict] = dataclasses.field(default_factory=dict)   # data path name -> its entry

    def to_bytes(self) -> bytes:
        d = {
            "version": VERSION, "worker_id": self.worker_id, "backends": list(self.backends),
            "host": self.host, "port": self.port, "layout": dataclasses.asdict(self.layout),
            "shm": None, "progress": self.progress, **self.entries,
        }
        if self.checksums:
            d["checksums"] = list(self.checksums)
        if self.layer_writes:
            d["layer_writes"] = list(self.layer_writes)
        return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ReceiverMetadata:
        try:
            d = json.loads(data)
            if d.get("version") != VERSION:
                raise TransferError(f"unsupported kvtransfer metadata version {d.get('version')!r}")
            return cls(
                worker_id=str(d["worker_id"]), layout=PoolLayout.from_dict(d["layout"]), host=str(d["host"]),
                port=int(d["port"]), backends=tuple(d["backends"]), progress=d.get("progress") is True,
                checksums=_names(d.get("checksums", [])), layer_writes=_names(d.get("layer_writes", [])),
                entries={k: v for k, v in d.items() if k not in _CORE_KEYS and isinstance(v, dict)},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise TransferError(f"bad kvtransfer metadata: {e}") from e


def _names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"checksums {value!r} is not a list of names")
    return tuple(value)


def configure(sock: socket.socket, timeouts: Timeouts) -> None:
    """Low latency for small frames; keepalive so a silently dead host fails its rooms; a send that
    stalls fails instead of hanging. The socket stays in blocking mode (no Python timeout) because the
    scatter/gather path calls the kernel directly on its file descriptor."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", timeouts.keepalive_idle), ("TCP_KEEPINTVL", timeouts.keepalive_intvl),
                        ("TCP_KEEPCNT", timeouts.keepalive_cnt)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT") and timeouts.user_timeout > 0:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeouts.user_timeout * 1000))
    sec = int(timeouts.send)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", sec, int((timeouts.send - sec) * 1e6)))
    sock.settimeout(None)


class Channel:
    """A framed, full-duplex connection. Any thread may send (frames never interleave: `send_lock`);
    one thread reads. `close` takes `send_lock`, so no sender can reach a recycled file descriptor."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.send_lock = threading.Lock()
        self.closed = False
        self._hdr = bytearray(HEADER.size)

    def send(self, kind: Kind, room: int = 0, body: bytes = b"", payload_len: int = 0) -> None:
        with self.send_lock:
            if self.closed:
                raise ConnectionError("channel closed")
            self.sock.sendall(HEADER.pack(kind, len(body), room, payload_len) + body)

    def try_send(self, kind: Kind, room: int = 0, body: bytes = b"") -> bool:
        try:
            self.send(kind, room, body)
            return True
        except OSError:
            return False

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ConnectionError("peer closed the connection")
            got += k
        return bytes(buf)

    def recv_header(self) -> tuple[Kind, int, int, int]:
        """(kind, body_len, room, payload_len); raises ConnectionError on EOF."""
        kind, body_len, room, payload_len = HEADER.unpack(self.recv_exact(HEADER.size))
        try:
            kind = Kind(kind)
        except ValueError:
            raise ProtocolError(f"unknown frame kind {kind}") from None
        if body_len > MAX_BODY:
            raise ProtocolError(f"frame body of {body_len} bytes")
        return kind, body_len, room, payload_len

    def recv_frame(self) -> tuple[Kind, int, bytes, int]:
        kind, body_len, room, payload_len = self.recv_header()
        return kind, room, self.recv_exact(body_len) if body_len else b"", payload_len

    def drain(self, n: int) -> None:
        """Read and discard n bytes."""
        scratch = bytearray(min(n, 1 << 20) or 1)
        view = memoryview(scratch)
        while n > 0:
            k = self.sock.recv_into(view, min(n, len(scratch)))
            if k == 0:
                raise ConnectionError("peer closed the connection")
            n -= k

    def shutdown(self) -> None:
        """Wake every thread blocked on this socket (they see EOF / an error). Does not free the fd."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        with self.send_lock:
            if not self.closed:
                self.closed = True
                self.sock.close()


def wrote_body(started: float, runs) -> bytes:
    """A WROTE note's body: when the copy began, then the (dst_start, length) of the runs `[n, 3]`
    (src_start, dst_start, length) that were copied, so the receiver can check they were the room's."""
    import numpy as np

    pairs = np.ascontiguousarray(np.asarray(runs, dtype=np.int64).reshape(-1, 3)[:, 1:], dtype="<i8")
    return WROTE_BODY.pack(started) + pairs.tobytes()


def split_layers(body: bytes, num_layers: int) -> tuple[tuple[int, int], bytes]:
    """A WRITE_LAYERS / WROTE_LAYERS body: ((first layer, end layer), the WRITE / WROTE body after it).
    Raises ProtocolError."""
    if len(body) < LAYERS_BODY.size:
        raise ProtocolError("layer write without its layer range")
    first, count = LAYERS_BODY.unpack_from(body)
    if count < 1 or first + count > num_layers:
        raise ProtocolError(f"a write of layers {first}..{first + count - 1} in a {num_layers}-layer pool")
    return (first, first + count), body[LAYERS_BODY.size:]


def layers_body(layers: tuple[int, int]) -> bytes:
    return LAYERS_BODY.pack(layers[0], layers[1] - layers[0])


def progress_body(p: Progress) -> bytes:
    return PROGRESS_BODY.pack(p.tokens_done, p.tokens_total, p.queued_ahead, p.expected_s)


def parse_progress(body: bytes, at: float) -> Progress:
    """A PROGRESS body, received at `at` (this side's monotonic clock). Raises ProtocolError."""
    if len(body) != PROGRESS_BODY.size:
        raise ProtocolError(f"PROGRESS body of {len(body)} bytes")
    done, total, ahead, expected_s = PROGRESS_BODY.unpack(body)
    if not math.isfinite(expected_s) or expected_s < 0:
        raise ProtocolError(f"PROGRESS with expected_s={expected_s}")
    return Progress(done, total, ahead, expected_s, at)


def dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"bad JSON body: {e}") from e
    if not isinstance(obj, dict):
        raise ProtocolError("JSON body is not an object")
    return obj


def serve_until_lost(loop: Callable[[], None], lost: Callable[[str], None], what: str) -> None:
    """Run a connection thread's `loop` until the connection ends, then `lost(reason)`: the one
    teardown of every connection thread on both sides. An I/O or protocol error is the reason; any
    other exception is a bug, logged with its stack, and still ends the connection, so the rooms on it
    fail instead of hanging."""
    reason = "connection closed by the peer"
    try:
        loop()
    except (OSError, TransferError) as e:
        reason = str(e) or type(e).__name__
    except Exception as e:
        log.exception("%s crashed", what)
        reason = f"{what} crashed: {e!r}"
    finally:
        lost(reason)
