"""The ucx backend's UCX plumbing: a ucxx worker with its progress thread, D's listener and the
endpoints it accepted (named by the token each sender sends first), and waiting on or cancelling
requests while watching the control connection."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import numpy as np

from tandem.kvtransfer.backends.ucx_env import UcxSettings
from tandem.kvtransfer.base import TransferError

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 5.0
_POLL_MAX_S = 0.001

_ucxx_modules: tuple | None = None      # (ucxx._lib.libucxx, ucxx._lib.arr.Array)
_UCXX_DEFAULTS: dict[str, str] = {}
_import_lock = threading.Lock()


def _ucxx() -> tuple:
    """Import ucxx once. Its import writes UCX_* defaults into os.environ; they are moved into the
    config of the contexts created here instead, so they do not leak into other UCX users (NIXL)."""
    global _ucxx_modules
    with _import_lock:
        if _ucxx_modules is None:
            before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
            try:
                import ucxx._lib.libucxx as api
                from ucxx._lib.arr import Array
            except ImportError as e:
                raise TransferError(f"the ucx backend needs ucxx (ucxx-cu12): {e}") from e
            finally:
                for k in [k for k in os.environ if k.startswith("UCX_")]:
                    if k not in before:
                        _UCXX_DEFAULTS[k[4:]] = os.environ.pop(k)
                    elif os.environ[k] != before[k]:
                        os.environ[k] = before[k]
            _ucxx_modules = (api, Array)
    return _ucxx_modules


class Node:
    """A ucxx context and worker with its progress thread."""

    def __init__(self, settings: UcxSettings, host: str | None):
        self.api, self._array = _ucxx()
        api = self.api
        config = {**_UCXX_DEFAULTS, **settings.ucx_config(host)}
        try:
            self.context = api.UCXContext(config_dict=config,
                                          feature_flags=(api.Feature.TAG, api.Feature.STREAM, api.Feature.WAKEUP))
            self.worker = api.UCXWorker(self.context)
            # Event-driven, but awake at least every millisecond: with shared-memory transports (cma,
            # error_handling="none") a completion can come without an event and would wait forever.
            self.worker.start_progress_thread(polling_mode=False, epoll_timeout=1)
        except Exception as e:
            raise TransferError(f"cannot start a UCX worker ({config}): {e}") from e
        self._closed = False

    def array(self, a: np.ndarray):
        return self._array(a)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.worker.stop_progress_thread()
            except Exception as e:
                log.warning("ucx: stopping the progress thread failed: %s", e)


def wait(req, up: Callable[[], bool]) -> None:
    """Wait for a request; TransferError if it failed or the control connection went down."""
    delay = 20e-6
    while not req.completed:
        if not up():
            raise TransferError("control connection lost while waiting for UCX")
        time.sleep(delay)
        delay = min(2 * delay, _POLL_MAX_S)
    try:
        req.check_error()
    except Exception as e:
        raise TransferError(f"UCX transfer failed: {e!r}") from e


def cancel(ep, requests) -> None:
    """Close the endpoint (cancelling what is posted on it) and wait until no request can still touch
    its buffer."""
    try:
        ep.close_blocking()
    except Exception as e:
        log.warning("ucx: closing an endpoint failed: %s", e)
    deadline = time.monotonic() + CANCEL_WAIT_S
    for req in requests:
        while not req.completed and time.monotonic() < deadline:
            time.sleep(0.001)
        if not req.completed:
            log.error("ucx: a request on a closed endpoint did not finish within %.0fs", CANCEL_WAIT_S)
            return


class Endpoints:
    """D side: endpoints accepted by the listener, named by the token each sender sends first."""

    def __init__(self, node: Node, error_handling: str):
        self._node = node
        self._peer_mode = error_handling == "peer"
        self._lock = threading.Lock()
        self._new: list = []                                  # accepted, hello not yet posted
        self._hello: list[tuple[object, np.ndarray, object]] = []   # (ep, buffer, request)
        self._by_token: dict[bytes, object] = {}
        self.listener = node.api.UCXListener.create(node.worker, 0, self._accept)

    def _accept(self, conn_request) -> None:                  # in the progress thread: no waiting here
        try:
            ep = self.listener.create_endpoint_from_conn_request(conn_request, self._peer_mode)
        except Exception as e:
            log.warning("ucx: cannot accept an endpoint: %s", e)
            return
        with self._lock:
            self._new.append(ep)

    def find(self, token: bytes, timeout: float, up: Callable[[], bool]):
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                for ep in self._new:
                    buf = np.zeros(16, dtype=np.uint8)
                    self._hello.append((ep, buf, ep.stream_recv(self._node.array(buf))))
                self._new.clear()
                pending, failed = [], []
                for ep, buf, req in self._hello:
                    if not req.completed:
                        pending.append((ep, buf, req))
                    elif ok(req):
                        self._by_token[buf.tobytes()] = ep
                    else:
                        failed.append(ep)                   # that sender went away before its hello
                self._hello = pending
                ep = self._by_token.get(token)
            for dead in failed:
                cancel(dead, [])
            if ep is not None:
                return ep
            if time.monotonic() > deadline or not up():
                raise TransferError("no UCX endpoint announced this sender's token")
            time.sleep(0.001)

    def drop(self, ep) -> None:
        with self._lock:
            for t in [t for t, e in self._by_token.items() if e is ep]:
                del self._by_token[t]

    def close(self) -> None:
        with self._lock:
            eps = list(self._by_token.values()) + [ep for ep, _, _ in self._hello] + self._new
            self._by_token.clear()
            self._hello.clear()
            self._new.clear()
        for ep in eps:
            try:
                ep.close_blocking()
            except Exception:
                pass
        self.listener = None


def ok(req) -> bool:
    try:
        req.check_error()
        return True
    except Exception:
        return False
