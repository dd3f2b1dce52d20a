"""Typed reads of a JSON request body: each failure is a 400 that names its `param`."""

from __future__ import annotations

from typing import Any

from ruvllm_cli.server.errors import ApiError, bad_request

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
               list: "an array", dict: "an object"}


def json_type_name(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in _TYPE_NAMES.items():
        if type(value) is kind:
            return name
    return type(value).__name__


def invalid_type(param: str, expected: str, value: Any) -> ApiError:
    return bad_request(f"Invalid type for '{param}': expected {expected}, but got {json_type_name(value)} instead.",
                       param, "invalid_type")


def string_list(value: list[Any], param: str, most: int) -> tuple[str, ...]:
    """A list of at most `most` strings (stop sequences), each refusal naming its place."""
    if len(value) > most:
        raise invalid_value(param, f"at most {most} stop sequences", f"{len(value)}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise invalid_type(f"{param}[{i}]", "a string", item)
    return tuple(value)


def invalid_value(param: str, rule: str, value: Any) -> ApiError:
    return bad_request(f"Invalid value for '{param}': {rule} (got {short_repr(value)}).", param, "invalid_value")


def short_repr(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters: an error must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Fields:
    """A request body (a JSON object); `null` counts as absent everywhere."""

    def __init__(self, body: Any, prefix: str = "") -> None:
        if not isinstance(body, dict):
            raise bad_request(f"The request body must be a JSON object, not {json_type_name(body)}.")
        self.body = body
        self.prefix = prefix  # names nested params in errors, e.g. "stream_options."

    def raw(self, name: str) -> Any:
        return self.body.get(name)

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def required(self, name: str) -> Any:
        if not self.has(name):
            param = self.prefix + name
            raise bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
        return self.body[name]

    def string(self, name: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self.required(name) if required else self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise invalid_type(self.prefix + name, "a string", value)
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid_type(self.prefix + name, "a boolean", value)
        return value

    def integer(self, name: str, default: int | None = None, *, low: int | None = None,
                high: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        # 4.0 is refused as OpenAI refuses it: an integer field takes integers only.
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_type(self.prefix + name, "an integer", value)
        check_range(self.prefix + name, value, low, high)
        return value

    def number(self, name: str, default: float, *, low: float | None = None, high: float | None = None) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid_type(self.prefix + name, "a number", value)
        check_range(self.prefix + name, value, low, high)
        return float(value)

    def object(self, name: str) -> "Fields | None":
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid_type(self.prefix + name, "an object", value)
        return Fields(value, f"{self.prefix}{name}.")


def check_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if low is not None and high is not None and not low <= value <= high:
        raise invalid_value(name, f"must be between {low} and {high}", value)
    if low is not None and value < low:
        raise invalid_value(name, f"must be at least {low}", value)
    if high is not None and value > high:
        raise invalid_value(name, f"must be at most {high}", value)
