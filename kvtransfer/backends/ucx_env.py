"""UCX settings for the nixl and ucx backends: the one place where they are read from the environment.

| field            | user's environment           | default                                  |
|------------------|------------------------------|------------------------------------------|
| `tls`            | `UCX_TLS`                    | unset: UCX picks (cma, shared memory, tcp, RDMA when present) |
| `net_devices`    | `UCX_NET_DEVICES`            | `lo` for a receiver bound to a loopback address, else unset (all devices) |
| `error_handling` | `TANDEM_UCX_ERROR_HANDLING`  | `peer`                                   |

Precedence: worker flags (the `overrides` of `from_env`) > the user's environment > these defaults.

`error_handling="peer"` lets UCX fail the transfers of a peer that died; it needs a transport that can
detect it (tcp), so keep `tcp` in `UCX_TLS`. `none` allows shared-memory-only `UCX_TLS` (posix, sysv,
cma: faster on one host) but a crashed peer is then noticed only through the control connection.
The receiver advertises its mode in its metadata and the sender follows it (UCX needs both ends of an
endpoint to agree).

Nothing here runs at import time: the backends call `process_env()` around creating their UCX
context, so `UCX_TLS` from a flag reaches UCX without staying in `os.environ` afterwards.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

ERROR_HANDLING_MODES = ("peer", "none")


@dataclass(frozen=True)
class UcxSettings:
    tls: str = ""                    # UCX_TLS; "" = UCX's own choice (never pass UCX an empty list)
    net_devices: str = ""            # UCX_NET_DEVICES; "" = `lo` for loopback receivers, else all devices
    error_handling: str = "peer"     # "peer" | "none"

    def __post_init__(self) -> None:
        if self.error_handling not in ERROR_HANDLING_MODES:
            raise ValueError(f"UCX error handling must be one of {ERROR_HANDLING_MODES}, not {self.error_handling!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: str) -> UcxSettings:
        """Settings from the user's environment; non-empty `overrides` (worker flags) win."""
        env = os.environ if environ is None else environ
        values = {
            "tls": env.get("UCX_TLS", "").strip(),
            "net_devices": env.get("UCX_NET_DEVICES", "").strip(),
            "error_handling": env.get("TANDEM_UCX_ERROR_HANDLING", "").strip().lower() or "peer",
        }
        values.update({k: v for k, v in overrides.items() if v})
        return cls(**values)

    def devices_for(self, host: str | None) -> str:
        """UCX_NET_DEVICES for a side bound to `host` (None: not bound to one address, e.g. a sender).

        A receiver on a loopback address cannot be reached from another host anyway, and without the
        restriction UCX splits one host's traffic over lo and eth0."""
        if self.net_devices:
            return self.net_devices
        return "lo" if host is not None and is_loopback(host) else ""

    def ucx_config(self, host: str | None) -> dict[str, str]:
        """UCX options (names without the UCX_ prefix) for a context created in this process."""
        cfg = {}
        if self.tls:
            cfg["TLS"] = self.tls
        devices = self.devices_for(host)
        if devices:
            cfg["NET_DEVICES"] = devices
        return cfg

    @contextlib.contextmanager
    def process_env(self) -> Iterator[None]:
        """Put `UCX_TLS` in the environment while a UCX context is created (NIXL reads it from there),
        then restore what was there."""
        if not self.tls or os.environ.get("UCX_TLS") == self.tls:
            yield
            return
        old = os.environ.get("UCX_TLS")
        os.environ["UCX_TLS"] = self.tls
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = old


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
