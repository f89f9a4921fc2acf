"""Exceptions the client raises: one per gRPC status family, carrying the server's message.

`str(err)` is the server's message; `err.code` the grpc.StatusCode; `err.param` the offending field
of an invalid request when the server named it.
"""

from __future__ import annotations

import grpc

# The trailing-metadata key under which Tandem's servers name the bad parameter.
PARAM_METADATA_KEY = "tandem-error-param"


class TandemError(Exception):
    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class InvalidRequestError(TandemError):
    """The request is wrong (a bad value, a prompt too long for the model): fix it, do not retry."""


class ModelNotFoundError(TandemError):
    """No worker serves the requested model."""


class ResourceExhaustedError(TandemError):
    """The server's queues are full: retry later."""


class UnavailableError(TandemError):
    """The server (or every worker) is unreachable; retried automatically before the first token."""


class DeadlineExceededError(TandemError):
    """The call's deadline passed."""


class RequestCancelledError(TandemError):
    """The call was cancelled (by this client, or by the server shutting down)."""


class AuthenticationError(TandemError):
    """The server refused the caller's credentials."""


class ServerError(TandemError):
    """The server failed (INTERNAL, UNKNOWN, ...)."""


_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: ModelNotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: RequestCancelledError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
}


def from_rpc_error(err: grpc.RpcError) -> TandemError:
    """The typed exception for a failed sync or asyncio call."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else None
    param = None
    trailing = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else None
    for key, value in trailing or ():
        if key == PARAM_METADATA_KEY:
            param = value.decode() if isinstance(value, bytes) else value
    return _BY_CODE.get(code, ServerError)(details or code.name, code, param)
