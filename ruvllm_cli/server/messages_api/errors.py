"""Errors in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.

The statuses stay the ones every route answers with (a 503 while the model loads
is a 503 here too); only the body and its error `type` follow Anthropic. The
message names the offending param, as it does on the OpenAI routes."""

from __future__ import annotations

from typing import Any

from ruvllm_cli.server.errors import ApiError

# Anthropic's error types by status (its docs: "invalid_request_error" also covers
# the 4xx it does not list, "api_error" stands for any 5xx it does not).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",   # loading or shutting down: retry later, as after Anthropic's 529
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(error.status), "message": error.message}}
