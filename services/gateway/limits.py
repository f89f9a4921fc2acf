"""The gateway's half of the request limits (services/common/limits.py): reading a body no larger
than --max-request-bytes (HTTP 413 otherwise, before the rest arrives), and limit errors as HTTP 400s."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from tandem.engine.errors import InvalidRequest
from tandem.services.gateway.errors import APIError, bad_request


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (--max-request-bytes)",
                    code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or APIError 413 as soon as it (or its declared Content-Length) exceeds `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_len = int(declared)
        except ValueError:
            raise bad_request("Content-Length is not a number") from None
        if declared_len > limit:
            raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def checked(check: Callable[..., None], *args) -> None:
    """Run a RequestLimits check; its InvalidRequest becomes a 400 naming the parameter."""
    try:
        check(*args)
    except InvalidRequest as e:
        raise bad_request(e.message, e.param) from None
