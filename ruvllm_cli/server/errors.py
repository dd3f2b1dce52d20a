"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, or
in another API's shape where a route answers as that API does (an ErrorShape,
chosen by the error middleware)."""

from __future__ import annotations

import json
from typing import Any, Callable

from aiohttp import web

from ruvllm_cli.errors import RuvllmError

# The `type` OpenAI puts in the error body for each status we answer with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
}


# Marks a response after which the connection closes at once, without first reading
# (for up to aiohttp's 10 s of lingering) what the client still sends (runner.py).
CLOSE_AT_ONCE = web.ResponseKey("ruvllm_close_at_once", bool)


class ApiError(Exception):
    """An HTTP error answer; raised anywhere in a handler, rendered by the middleware."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.close = close   # close the connection right after answering (CLOSE_AT_ONCE)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self, shape: "ErrorShape | None" = None) -> web.Response:
        """The answer, its body in OpenAI's shape unless `shape` gives another."""
        body = shape(self) if shape is not None else self.body()
        # Never fails: a message may quote client input that UTF-8 cannot carry.
        response = web.Response(body=json_bytes(body), status=self.status, content_type="application/json",
                                headers=self.headers)
        if self.close:
            response.force_close()
            response[CLOSE_AT_ONCE] = True
        return response

    @classmethod
    def from_ruvllm(cls, error: RuvllmError, param: str | None = None) -> "ApiError":
        """Our own exceptions carry an HTTP status; keep their message, drop the CLI hint."""
        return cls(error.http_status, error.message, param=param)


# An error's body in some API's shape.
ErrorShape = Callable[[ApiError], dict[str, Any]]


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def json_response(data: Any, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=json_bytes(data), status=status, content_type="application/json", headers=headers)


def json_bytes(data: Any) -> bytes:
    """`data` as UTF-8 JSON. Text UTF-8 cannot encode (a lone surrogate) comes out as a
    JSON escape instead of an exception, and an object JSON does not know as its str."""
    try:
        return json.dumps(data, ensure_ascii=False, default=str).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(data, ensure_ascii=True, default=str).encode("ascii")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
