"""The one mapping between Tandem's typed errors and gRPC status codes, both directions.

Servers raise `engine.errors` exceptions and turn them into a status at the edge with `abort_with`;
clients turn an `RpcError` back into a typed error with `error_from_rpc`. The offending parameter of
an `InvalidRequest` travels in the trailing metadata under `PARAM_METADATA_KEY`, so a gateway can
report it (OpenAI's `error.param`) without parsing messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import grpc

from tandem.engine.errors import (
    Conflict,
    InvalidRequest,
    ModelNotFound,
    RequestAborted,
    ResourceExhausted,
    TandemError,
)

PARAM_METADATA_KEY = "tandem-error-param"
# The worker a failure is due to when it is not the one that answered (a decode worker whose prefill
# peer died): the router counts the failure against that worker and retries without it.
FAILED_WORKER_METADATA_KEY = "tandem-failed-worker"

# Most specific first: the first matching class wins.
_CODE_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RequestAborted, grpc.StatusCode.CANCELLED),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
)
_ERROR_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {code: cls for cls, code in _CODE_BY_ERROR}


class RpcFailed(TandemError):
    """A remote call failed with a status that has no typed Tandem error (UNAVAILABLE, INTERNAL, ...).
    `failed_worker`: the worker at fault when it is another one than the server answering."""

    def __init__(self, code: grpc.StatusCode, message: str, failed_worker: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.failed_worker = failed_worker


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status a server answers for `exc`; INTERNAL for anything that is not a typed caller error."""
    if isinstance(exc, RpcFailed):
        return exc.code
    for cls, code in _CODE_BY_ERROR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def trailing_metadata_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    param = getattr(exc, "param", None)
    culprit = getattr(exc, "failed_worker", "")
    return ((PARAM_METADATA_KEY, param),) * bool(param) + ((FAILED_WORKER_METADATA_KEY, culprit),) * bool(culprit)


def failed_worker_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    for key, value in metadata or ():
        if key == FAILED_WORKER_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return ""


async def abort(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    trailing_metadata: Sequence[tuple[str, str]] = (),
) -> NoReturn:
    """End the RPC with `code` and `message` (raises, like `context.abort`)."""
    await context.abort(code, message, tuple(trailing_metadata))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the RPC with the status mapped from `exc`, its message, and its `param` when it has one."""
    await abort(context, status_for(exc), str(exc) or type(exc).__name__, trailing_metadata_for(exc))


def param_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == PARAM_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return None


def error_from_status(code: grpc.StatusCode, message: str, param: str | None = None) -> TandemError:
    """The typed error a client raises for a failed call (RpcFailed when the code has no typed error)."""
    cls = _ERROR_BY_CODE.get(code)
    if cls is InvalidRequest:
        return InvalidRequest(message, param)
    if cls is not None:
        return cls(message)
    return RpcFailed(code, message)


def error_from_rpc(err: grpc.RpcError) -> TandemError:
    """`error_from_status` for a grpc (sync or aio) RpcError, reading `param` from its trailing metadata."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    trailing = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else None
    return error_from_status(code, details or code.name, param_from_metadata(trailing))
