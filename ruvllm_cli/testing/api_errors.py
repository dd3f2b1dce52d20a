"""Assertions on the server's error answers, shared by the server tests."""

from __future__ import annotations

from typing import Any


def assert_error(response: Any, status: int, param: str | None = None, code: str | None = None,
                 contains: str = "") -> dict[str, Any]:
    """`response` (httpx) is an error in OpenAI's shape with this status and `param`
    (and `code`, and a message containing `contains`, where given); returns the error."""
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert contains in error["message"], error
    assert "Traceback" not in response.text
    return error
