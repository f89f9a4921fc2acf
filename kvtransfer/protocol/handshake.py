"""Opening of a control connection: challenge, hello, acknowledgement; proof of the shared secret.

    D (receiver) -> P: CHALLENGE   32 random bytes, fresh per connection
    P (sender)   -> D: HELLO       JSON {version, worker_id, epoch, path, layout, checksum, nonce, proof}
    D            -> P: HELLO_ACK   JSON {ok, error, aborted: [room...], proof}

With a key (services/common/auth.py derives it from the deployment's secret), `proof` in HELLO is
HMAC-SHA256(key, "hello" | challenge | nonce | receiver id | sender id | epoch | path): it shows the
sender holds the key, for this connection only (the challenge is fresh, so a recorded hello cannot be
replayed). The ack's proof, over the same challenge and the sender's nonce, shows P that it talks to a
receiver holding the key too. Without a key neither side checks, and a side with a key refuses a
peer without one. The sender's id and boot epoch named in an accepted hello are what the receiver
binds rooms to (`KVReceiver.expect`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass

from tandem.kvtransfer.base import PoolLayout, TransferError
from tandem.kvtransfer.protocol.wire import (
    HEADER,
    VERSION,
    Channel,
    Kind,
    ProtocolError,
    Timeouts,
    dumps,
    loads,
)

log = logging.getLogger(__name__)

CHALLENGE_BYTES = 32


def _proof(key: bytes, label: str, *parts: str | bytes | int) -> str:
    mac = hmac.new(key, label.encode(), hashlib.sha256)
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        mac.update(len(data).to_bytes(4, "little") + data)   # length-prefixed: no ambiguous splits
    return mac.hexdigest()


def _same(a: object, b: str) -> bool:
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())


@dataclass(frozen=True)
class Hello:
    """What an accepted sender said about itself."""

    peer_id: str
    epoch: int
    path: str
    nonce: str
    checksum: str = ""           # the checksum of the SUMS frames it sends ("": none, a sender from before them)


class RefusalLog:
    """A warning per refused connection, at most one per `period_s` per reason (a scanner cannot
    flood the log); the count of refusals is kept."""

    def __init__(self, period_s: float = 10.0):
        self.period_s = period_s
        self.count = 0
        self._last: dict[str, float] = {}

    def refused(self, what: str, peer: object, why: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._last.get(why, -1e9) >= self.period_s:
            if len(self._last) > 1024:
                self._last.clear()
            self._last[why] = now
            log.warning("%s refused %s: %s", what, peer, why)


# ---- receiver (D) ------------------------------------------------------------------------------------

def send_challenge(ch: Channel) -> bytes:
    challenge = secrets.token_bytes(CHALLENGE_BYTES)
    ch.send(Kind.CHALLENGE, 0, challenge)
    return challenge


def check_hello(body: bytes, *, key: bytes | None, challenge: bytes, receiver_id: str, layout: PoolLayout,
                backends: tuple[str, ...], checksums: tuple[str, ...] = ()) -> tuple[Hello | None, str]:
    """(the sender's hello, "") if it may connect, else (what could be read of it, why not)."""
    d = loads(body)
    try:
        hello = Hello(peer_id=str(d["worker_id"]), epoch=int(d.get("epoch", 0)), path=str(d["path"]),
                      nonce=str(d.get("nonce", "")), checksum=str(d.get("checksum") or ""))
        their_layout = PoolLayout.from_dict(d["layout"])
    except (KeyError, TypeError, ValueError) as e:
        return None, f"bad hello: {e!r}"
    if key is not None:
        expected = _proof(key, "hello", challenge, hello.nonce, receiver_id, hello.peer_id, hello.epoch, hello.path)
        if "proof" not in d:
            return hello, "the sender presented no proof of the shared secret"
        if not _same(d["proof"], expected):
            return hello, "the sender's proof of the shared secret is wrong"
    if d.get("version") != VERSION:
        return hello, f"protocol version {d.get('version')!r}, receiver speaks {VERSION}"
    if not their_layout.compatible(layout):
        return hello, f"incompatible pool layouts: receiver {layout}, sender {their_layout}"
    if hello.path not in backends:
        return hello, f"receiver {receiver_id} accepts {list(backends)}, not {hello.path!r}"
    if hello.checksum and hello.checksum not in checksums:
        return hello, f"receiver {receiver_id} checks {list(checksums)}, not {hello.checksum!r}"
    return hello, ""


def ack_body(*, key: bytes | None, challenge: bytes, receiver_id: str, hello: Hello | None, error: str,
             aborted: list[int]) -> bytes:
    ack: dict = {"ok": not error, "error": error, "aborted": aborted}
    if key is not None and not error and hello is not None:
        ack["proof"] = _proof(key, "ack", challenge, hello.nonce, receiver_id, hello.peer_id)
    return dumps(ack)


# ---- sender (P) --------------------------------------------------------------------------------------

def open_connection(ch: Channel, *, key: bytes | None, sender_id: str, epoch: int, receiver_id: str, path: str,
                    layout: PoolLayout, timeouts: Timeouts, checksum: str = "") -> list[int]:
    """The sender's half on a fresh connection; returns the rooms D says it aborted already. `checksum`:
    the algorithm of the SUMS frames this sender will send ("": none).
    Raises TransferError (refused, or the receiver could not prove the key) or OSError."""
    ch.sock.settimeout(timeouts.connect)
    kind, _, challenge, _ = ch.recv_frame()
    if kind != Kind.CHALLENGE or len(challenge) != CHALLENGE_BYTES:
        raise ProtocolError(f"expected a CHALLENGE from {receiver_id}, got {kind.name}")
    nonce = secrets.token_hex(16)
    hello = {"version": VERSION, "worker_id": sender_id, "epoch": epoch, "path": path, "nonce": nonce,
             "layout": dataclasses.asdict(layout)}
    if checksum:
        hello["checksum"] = checksum
    if key is not None:
        hello["proof"] = _proof(key, "hello", challenge, nonce, receiver_id, sender_id, epoch, path)
    body = dumps(hello)
    ch.sock.sendall(HEADER.pack(Kind.HELLO, len(body), 0, 0) + body)
    kind, _, body, _ = ch.recv_frame()
    if kind != Kind.HELLO_ACK:
        raise ProtocolError(f"expected HELLO_ACK, got {kind.name}")
    ack = loads(body)
    if not ack.get("ok"):
        raise TransferError(f"{receiver_id} refused the connection: {ack.get('error')}")
    if key is not None and not _same(ack.get("proof"), _proof(key, "ack", challenge, nonce, receiver_id, sender_id)):
        raise TransferError(f"{receiver_id} could not prove the shared secret: not sending it KV")
    ch.sock.settimeout(None)
    return [int(x) for x in ack.get("aborted", [])]
