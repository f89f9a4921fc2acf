"""Channel construction (plain or TLS) and the retry/deadline arithmetic both clients share."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import grpc

from tandem_client.types import RetryPolicy, TLSConfig

MAX_MESSAGE_BYTES = 64 << 20
_BASE_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()  # "the client's default timeout" (None would mean "no deadline")


def call_metadata(metadata: Sequence[tuple[str, str]], api_key: str | None) -> tuple[tuple[str, str], ...]:
    """What every call sends: `metadata`, plus `authorization: Bearer KEY` when an API key is given."""
    if api_key is None:
        return tuple(metadata)
    if not api_key.strip():
        raise ValueError("api_key must not be empty")
    return (*metadata, ("authorization", f"Bearer {api_key.strip()}"))


def channel_args(tls: bool | TLSConfig, options: Sequence[tuple[str, Any]]):
    """(credentials or None, options) for grpc.{,aio.}{secure,insecure}_channel."""
    opts = list(_BASE_OPTIONS) + list(options)
    if not tls:
        return None, opts
    cfg = tls if isinstance(tls, TLSConfig) else TLSConfig()
    if cfg.server_name:
        opts.append(("grpc.ssl_target_name_override", cfg.server_name))
    creds = grpc.ssl_channel_credentials(cfg.root_certificates, cfg.private_key, cfg.certificate_chain)
    return creds, opts


class Attempts:
    """One call's retry budget: UNAVAILABLE before the first chunk, within the deadline."""

    def __init__(self, policy: RetryPolicy, timeout: float | None):
        self.policy = policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.attempt = 1

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def next_delay(self, code: grpc.StatusCode, received: bool) -> float | None:
        """Seconds to wait before the next attempt, or None when the failure is final."""
        if code != grpc.StatusCode.UNAVAILABLE or received or self.attempt >= self.policy.max_attempts:
            return None
        delay = random.uniform(0, self.policy.backoff(self.attempt))  # full jitter
        remaining = self.remaining()
        if remaining is not None and delay >= remaining:
            return None
        self.attempt += 1
        return delay
