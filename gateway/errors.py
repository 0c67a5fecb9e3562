"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status
for each of our gRPC status codes (the table in docs/openai.md), and for what the HTTP layer itself
refuses (an unknown route, a wrong method, a body too large or too slow, a server fault)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import grpc
from fastapi.responses import JSONResponse

# gRPC code -> (HTTP status, OpenAI error type)
STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.FAILED_PRECONDITION: (503, "service_unavailable"),  # still starting
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}

# HTTP status -> OpenAI error type, for the statuses the HTTP layer answers on its own
KIND: dict[int, str] = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
    504: "timeout",
}

# what a server fault says to the client: its traceback and our paths stay in the log
INTERNAL_MESSAGE = "the server failed on this request; it is logged, and the request may be retried"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = dict(headers or {})
        if status == 401:
            self.headers.setdefault("WWW-Authenticate", "Bearer")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)

    def raw(self, default_headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
        """The whole HTTP/1.1 response, for the protocol layer (gateway/server.py), which answers
        before there is an ASGI request to answer through; the connection closes after it."""
        body = json.dumps(self.body()).encode()
        lines = [f"HTTP/1.1 {self.status} {_phrase(self.status)}".encode()]
        lines += [name + b": " + value for name, value in default_headers]
        lines += [f"{k}: {v}".encode("latin-1") for k, v in self.headers.items()]
        lines += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close"]
        return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def from_grpc(exc: grpc.aio.AioRpcError, message: str | None = None) -> ApiError:
    """`message`: the client's words for the call's details, when they differ (gateway/upstream.py)."""
    status, kind = STATUS.get(exc.code(), (500, "internal_error"))
    return ApiError(status, message or exc.details() or exc.code().name, kind, code=exc.code().name.lower())


def from_http(status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None) -> ApiError:
    """An error the HTTP layer answers (Starlette's 404 and 405, the body's limits), typed by status."""
    return ApiError(status, message, KIND.get(status, "invalid_request_error"), code=code, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def internal_error() -> ApiError:
    return ApiError(500, INTERNAL_MESSAGE, "internal_error", code="internal_error")
