"""Who may call what: the shared secret of internal gRPC, the public API key, the transfer key.

Internal calls (router -> workers: Prefill, Decode, Generation of co-located workers, WorkerIdentity;
decode -> prefill: Bootstrap, AbortRoom) carry the deployment's shared secret in the metadata key
`INTERNAL_TOKEN_KEY`; one server interceptor refuses a call without it (UNAUTHENTICATED) and one
client interceptor attaches it. The router's public services (`tandem.v1.Generation` and the
reflection that describes it) take an optional API key (`authorization: Bearer KEY`, as vLLM's
--api-key), or the internal secret (the gateway is internal). Health checks stay open everywhere,
API key or not: Kubernetes' gRPC probes send no metadata. Without a configured secret everything is
open, as before, and the process says so once at start.

The KV transfer handshake (kvtransfer/protocol/handshake.py) never sees the secret itself: it proves
knowledge of `transfer_key`, a key derived from it, with an HMAC over a fresh challenge.

The environment is read here and nowhere else (`InternalAuth.load`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health

from tandem.services.common import keepalive
from tandem.services.common.arg_groups import SECURITY
from tandem.services.common.flags import SERVICES, Flag, Owner
from tandem.services.common.tls import TlsFiles

log = logging.getLogger(__name__)

TOKEN_ENV = "TANDEM_INTERNAL_TOKEN"
API_KEY_ENV = "TANDEM_API_KEY"
INTERNAL_TOKEN_KEY = "tandem-internal-token"   # gRPC metadata key of the internal secret
AUTHORIZATION_KEY = "authorization"            # gRPC metadata key of the public API key ("Bearer KEY")
OPEN_SERVICES = frozenset({health.SERVICE_NAME})
MIN_TOKEN_CHARS = 16
_TRANSFER_KEY_LABEL = b"tandem kvtransfer handshake v1"


class AuthConfigError(ValueError):
    """A secret could not be loaded (missing or empty file, too short)."""


def _digest(secret: bytes) -> bytes:
    # Compare fixed-length digests: compare_digest on raw values would leak the length.
    return hashlib.sha256(secret).digest()


def read_token_file(path: str) -> bytes:
    """The secret in `path` (surrounding whitespace stripped). Warns when every user may read the file."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read().strip()
    except OSError as e:
        raise AuthConfigError(f"cannot read the internal token file {path}: {e.strerror}") from None
    if mode & stat.S_IRWXO:   # group access is how Kubernetes mounts a Secret for a pod's fsGroup
        log.warning("internal token file %s is readable by every user (mode %o): chmod 600 it",
                    path, stat.S_IMODE(mode))
    return token


@dataclass(frozen=True)
class InternalAuth:
    """The deployment's internal secret (None: internal endpoints are open). Never printed."""

    token: bytes | None = field(default=None, repr=False)
    tls: TlsFiles | None = None          # internal mutual TLS (services/common/tls.py); None: plaintext

    def __post_init__(self):
        if self.token is None:
            return
        if len(self.token) < MIN_TOKEN_CHARS:
            raise AuthConfigError(f"the internal token must have at least {MIN_TOKEN_CHARS} characters")
        if not all(0x21 <= b <= 0x7E for b in self.token):
            # It travels as a gRPC metadata value: printable ASCII without spaces.
            raise AuthConfigError("the internal token must be printable ASCII without spaces")

    @classmethod
    def load(cls, token_file: str | None = None, environ: Mapping[str, str] | None = None,
             tls: TlsFiles | None = None) -> InternalAuth:
        """From `--internal-token-file` if given, else $TANDEM_INTERNAL_TOKEN, else open."""
        env = os.environ if environ is None else environ
        if token_file:
            token = read_token_file(token_file)
            if not token:
                raise AuthConfigError(f"the internal token file {token_file} is empty")
            return cls(token, tls)
        value = env.get(TOKEN_ENV, "").strip()
        return cls(value.encode() if value else None, tls)

    @property
    def enabled(self) -> bool:
        return self.token is not None

    @property
    def transfer_key(self) -> bytes | None:
        """The key the KV transfer handshake proves (derived: the secret never crosses that wire)."""
        if self.token is None:
            return None
        return hmac.new(self.token, _TRANSFER_KEY_LABEL, hashlib.sha256).digest()

    def announce(self, what: str) -> None:
        """One log line at start saying whether `what` is protected."""
        if self.enabled:
            log.info("%s: internal gRPC and KV transfers require the shared secret%s", what,
                     " (internal gRPC over mutual TLS)" if self.tls is not None else "")
        else:
            log.warning("%s: no internal token ($%s or --internal-token-file): internal gRPC and KV "
                        "transfers accept anyone who can reach them", what, TOKEN_ENV)

    def server_interceptor(self, public_services: Iterable[str] = (), api_key: str | None = None,
                           ) -> AuthInterceptor:
        return AuthInterceptor(self.token, public_services, api_key.encode() if api_key else None)

    def client_interceptors(self) -> list:
        if self.token is None:
            return []
        return [_AttachToUnary(self.token), _AttachToStream(self.token)]

    def channel(self, addr: str, options=None) -> grpc.aio.Channel:
        """A grpc.aio channel to an internal server whose calls carry the secret (over mutual TLS
        when configured): every internal client uses this. It pings its server (keepalive.py), so a
        silent peer fails its calls within keepalive.DETECT_BOUND_S instead of hanging them."""
        options = (*keepalive.CLIENT_OPTIONS, *(options or ()))
        if self.tls is not None:
            return grpc.aio.secure_channel(addr, self.tls.channel_credentials(), options=options,
                                           interceptors=self.client_interceptors())
        return grpc.aio.insecure_channel(addr, options=options, interceptors=self.client_interceptors())

    def add_port(self, server: grpc.aio.Server, addr: str) -> int:
        """Listen on `addr` as an internal server (mutual TLS when configured); returns the port."""
        if self.tls is not None:
            return server.add_secure_port(addr, self.tls.server_credentials())
        return server.add_insecure_port(addr)


def deployment_env(environ: Mapping[str, str], token_file: str | None) -> dict[str, str]:
    """The environment `tandem up` starts its children with: its own, plus a fresh random secret unless
    one is configured (a file, forwarded as a flag, or $TANDEM_INTERNAL_TOKEN). The environment, unlike
    the command line, is readable only by the same user (/proc/PID/environ is 0400)."""
    env = dict(environ)
    if token_file is None and not env.get(TOKEN_ENV, "").strip():
        env[TOKEN_ENV] = secrets.token_urlsafe(32)
    return env


def load_api_key(value: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The public API key: `--api-key`, else $TANDEM_API_KEY, else None (no key required)."""
    if value is None:
        value = (os.environ if environ is None else environ).get(API_KEY_ENV) or None
    if value is not None and not value.strip():
        raise AuthConfigError("--api-key must not be empty")
    return value.strip() if value is not None else None


INTERNAL_TOKEN_FILE = Flag(
    ("--internal-token-file",), SERVICES, SECURITY,
    f"file holding the shared secret that internal gRPC calls and KV transfers must present (default: "
    f"${TOKEN_ENV}; neither set: internal endpoints are open; `tandem up` generates one for its children). "
    f"Health checks and metrics stay open", metavar="PATH")
# `tandem up` passes it to its router and gateway in their environment (argv shows in `ps`).
API_KEY = Flag(
    ("--api-key",), Owner.ROUTER | Owner.GATEWAY | Owner.LAUNCHER, SECURITY,
    f"require this key of API callers: `Authorization: Bearer KEY` on the HTTP gateway, the metadata "
    f"`authorization: Bearer KEY` on the router's tandem.v1.Generation and its reflection (where the internal "
    f"token, which the gateway sends, is accepted too) (default: ${API_KEY_ENV}; unset = no key required)",
    up=Owner.LAUNCHER)


def _host(peer: str) -> str:
    # "ipv4:127.0.0.1:53412" -> "127.0.0.1": one log line per caller host, whatever its source port.
    kind, _, rest = (peer or "").partition(":")
    return rest.rpartition(":")[0] or peer if kind in ("ipv4", "ipv6") else peer


def _service_of(method: str) -> str:
    # "/tandem.v1.PrefillWorker/Prefill" -> "tandem.v1.PrefillWorker"
    return method.lstrip("/").split("/", 1)[0]


class _RateLimitedLog:
    """At most one warning per (peer host, method, reason) every `period_s`: a scanner cannot flood the log."""

    def __init__(self, period_s: float = 10.0, max_keys: int = 4096):
        self.period_s, self.max_keys = period_s, max_keys
        self._last: dict[tuple[str, str, str], float] = {}

    def warn(self, peer: str, method: str, why: str) -> None:
        now = time.monotonic()
        key = (peer, method, why)
        if now - self._last.get(key, -1e9) < self.period_s:
            return
        if len(self._last) >= self.max_keys:
            self._last.clear()
        self._last[key] = now
        log.warning("refused %s from %s: %s", method, peer or "unknown peer", why)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Server side. Health is open; `public_services` need `api_key` (when set) or the internal secret;
    everything else needs the internal secret (when set). Comparisons are constant-time; the log line
    of a refusal names the method and the reason, never a presented value."""

    def __init__(self, token: bytes | None, public_services: Iterable[str] = (), api_key: bytes | None = None):
        self._token = _digest(token) if token is not None else None
        self._api_key = _digest(api_key) if api_key is not None else None
        self._public = frozenset(public_services)
        self._log = _RateLimitedLog()
        self.refused = 0

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]]) -> str:
        """Why a call must be refused ("" when it may go on)."""
        service = _service_of(method)
        if service in OPEN_SERVICES:
            return ""
        values: dict[str, bytes] = {}
        for key, value in metadata or ():
            values.setdefault(key, value.encode() if isinstance(value, str) else value)
        token_ok = self._token is not None and hmac.compare_digest(
            _digest(values.get(INTERNAL_TOKEN_KEY, b"")), self._token)
        if service in self._public:
            if self._api_key is None or token_ok:
                return ""
            auth = values.get(AUTHORIZATION_KEY, b"")
            if not auth.startswith(b"Bearer "):
                return "no API key (send `authorization: Bearer KEY`)"
            return "" if hmac.compare_digest(_digest(auth[7:].strip()), self._api_key) else "wrong API key"
        if self._token is None or token_ok:
            return ""
        return "wrong internal token" if INTERNAL_TOKEN_KEY in values else "no internal token"

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        why = self.check(method, handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if not why or handler is None:
            return handler
        self.refused += 1
        return _refusing(handler, why, lambda peer: self._log.warn(peer, method, why))


def _refusing(handler: grpc.RpcMethodHandler, why: str, on_refuse: Callable[[str], None]) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED (and tells
    `on_refuse` the caller's address, which only the handler's context knows)."""
    message = f"unauthenticated: {why}"

    async def unary(request, context):
        on_refuse(_host(context.peer()))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        on_refuse(_host(context.peer()))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    kinds: dict[str, tuple[Callable, Callable]] = {
        "unary_unary": (grpc.unary_unary_rpc_method_handler, unary),
        "unary_stream": (grpc.unary_stream_rpc_method_handler, streaming),
        "stream_unary": (grpc.stream_unary_rpc_method_handler, unary),
        "stream_stream": (grpc.stream_stream_rpc_method_handler, streaming),
    }
    for attr, (make, fn) in kinds.items():
        if getattr(handler, attr) is not None:
            # No request deserializer: a stranger's bytes are never parsed.
            return make(fn, request_deserializer=None, response_serializer=handler.response_serializer)
    raise AssertionError(f"handler of no known kind: {handler!r}")


class _AttachToken:
    """Client side: every call carries the internal secret."""

    def __init__(self, token: bytes):
        self._item = (INTERNAL_TOKEN_KEY, token.decode())

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._item)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# grpc.aio files an interceptor under the first kind it is an instance of: one object per kind.
class _AttachToUnary(_AttachToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self.details(client_call_details), request)


class _AttachToStream(_AttachToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self.details(client_call_details), request)
