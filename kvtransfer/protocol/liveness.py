"""Is a control connection still up, asked without reading from it.

The nixl and ucx data paths wait on UCX requests while the peer's control connection (the one that
carries hello, FINISH and ABORT frames) is read by another thread, or not at all. The kernel's TCP
state says whether the peer closed (a killed process's socket is closed by its kernel), the
connection was reset, keepalive gave up, or this side shut it down, even when unread frames are
still queued in front of the end of the stream.
"""

from __future__ import annotations

import socket

_TCP_ESTABLISHED = 1          # first byte of struct tcp_info (Linux)


def connection_up(sock: socket.socket) -> bool:
    """False once the connection is closed, half-closed, reset or shut down."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)
    except AttributeError:        # no TCP_INFO on this platform: only a closed socket is noticed
        return sock.fileno() >= 0
    except OSError:
        return False
    return info[0] == _TCP_ESTABLISHED
