"""The one mapping from failures to OpenAI-style HTTP errors: `{"error": {message, type, param, code}}`.

Every path out of the gateway that is not a success goes through `APIError`, so a client never sees
a bare 500 traceback. gRPC statuses from the router map as below; the offending parameter of an
INVALID_ARGUMENT travels in the router's trailing metadata (services/common/grpc_errors).
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from tandem.services.common.grpc_errors import param_from_metadata

# HTTP status -> OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "service_unavailable",
    504: "timeout",
}

# HTTP status -> Anthropic error type (the Messages API's shape: {"type": "error", "error": {type, message}})
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

HTTP_STATUS_BY_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status == 401:
            self.headers["WWW-Authenticate"] = "Bearer"

    @property
    def type(self) -> str:
        # A client error without its own type is still the client's: only 5xx are server errors.
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def anthropic_response(self) -> JSONResponse:
        """The error as Anthropic's API writes it (the parameter, if any, is named in the message)."""
        return JSONResponse(self.anthropic_body(), status_code=self.status, headers=self.headers or None)

    @classmethod
    def from_http(cls, status: int, detail: str, method: str, path: str,
                  headers: dict[str, str] | None = None) -> APIError:
        """An HTTP error raised by the web framework itself (routing: unknown path, wrong method)."""
        if status == 404:
            return cls(404, f"Invalid URL ({method} {path}): no such endpoint", code="unknown_url")
        if status == 405:
            allow = next((v for k, v in (headers or {}).items() if k.lower() == "allow"), "")
            hint = f"; use {allow}" if allow else ""
            return cls(405, f"{method} is not allowed on {path}{hint}", code="method_not_allowed", headers=headers)
        return cls(status, detail, headers=headers)

    @classmethod
    def from_rpc(cls, err: grpc.aio.AioRpcError) -> APIError:
        code = err.code()
        status = HTTP_STATUS_BY_GRPC.get(code, 500)
        message = err.details() or code.name
        if status == 500:
            message = f"router error ({code.name}): {message}"
        param = param_from_metadata(err.trailing_metadata()) if status == 400 else None
        return cls(status, message, param, code.name.lower())


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
