"""Typed errors a caller can act on. Services map them to gRPC / HTTP statuses in one place."""

from __future__ import annotations


class TandemError(Exception):
    """Base class of every error Tandem raises on purpose."""


class InvalidRequest(TandemError, ValueError):
    """The request itself is wrong (maps to INVALID_ARGUMENT / HTTP 400).

    `param` names the offending field in the public API's spelling (e.g. "top_p").
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
        self.message = message


class ModelNotFound(TandemError, FileNotFoundError):
    """A model name or path that does not resolve to a loadable model (NOT_FOUND / HTTP 404)."""


class ResourceExhausted(TandemError):
    """A bounded queue is full or the request can never fit in memory (RESOURCE_EXHAUSTED / 429)."""


class Conflict(TandemError):
    """The operation conflicts with work in flight (unloading a LoRA adapter requests use):
    FAILED_PRECONDITION / HTTP 409. Retry once that work is done."""


class RequestAborted(TandemError):
    """The request was cancelled or aborted before it finished."""


class GrammarViolation(TandemError):
    """A token the request's grammar refuses arrived from elsewhere (a decode worker given a first
    token by its prefill worker): the request fails rather than output it."""
