"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (TOOL_FIELDS), parsed
into the engine's ToolRequest; each malformed field is a 400 naming its param."""

from __future__ import annotations

from typing import Any

from ruvllm_cli.engine.tools import TOOL_NAME, Tool, ToolChoice, ToolRequest
from ruvllm_cli.errors import UsageError
from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import Fields, invalid_type, invalid_value
from ruvllm_cli.server.spec import Field

MAX_TOOLS = 512
_CHOICES = ("auto", "none", "required")


def tool_request(values: dict[str, Any]) -> ToolRequest | None:
    """The request's tools (None when it has none) from its TOOL_FIELDS values."""
    tools, choice, parallel = values["tools"], values["tool_choice"], values["parallel_tool_calls"]
    if not tools:
        if choice.forced:
            raise bad_request(f"'tool_choice' {choice.mode!r} needs 'tools'.", "tool_choice", "invalid_value")
        return None
    try:
        return ToolRequest(tuple(tools), choice, parallel)
    except UsageError as error:
        param = "tool_choice" if "tool_choice" in error.message else "tools"
        raise bad_request(error.message[0].upper() + error.message[1:] + ".", param, "invalid_value") from error


def _tools(value: list[Any]) -> list[Tool]:
    if len(value) > MAX_TOOLS:
        raise invalid_value("tools", f"at most {MAX_TOOLS} tools", f"{len(value)} tools")
    return [_tool(item, f"tools[{i}]") for i, item in enumerate(value)]


def _tool(item: Any, where: str) -> Tool:
    if not isinstance(item, dict):
        raise invalid_type(where, "an object", item)
    if item.get("type", "function") != "function":
        raise invalid_value(f"{where}.type", "only function tools are supported", item.get("type"))
    function = Fields(item, f"{where}.").object("function")
    if function is None:
        raise bad_request(f"Missing required parameter: '{where}.function'.", f"{where}.function",
                          "missing_required_parameter")
    name = function.string("name", required=True) or ""
    parameters = function.raw("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid_type(f"{where}.function.parameters", "an object (a JSON schema)", parameters)
    check_object_schema(parameters, f"{where}.function.parameters")
    strict = function.raw("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_type(f"{where}.function.strict", "a boolean", strict)
    try:
        tool = Tool(name, parameters or {"type": "object", "properties": {}}, function.string("description"),
                    strict=bool(strict))
    except UsageError as error:
        raise invalid_value(f"{where}.function.name", error.message, name) from error
    return tool


def check_object_schema(schema: dict[str, Any] | None, param: str) -> None:
    """A tool's arguments are an object (OpenAI's `parameters` and Anthropic's
    `input_schema` say so): a schema of another type is a 400 here, where it used to
    give calls whose arguments were lost ("" or a 500)."""
    kind = (schema or {}).get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise invalid_value(f"{param}.type", "a tool's arguments are an object: its schema's type must be 'object'",
                            kind)


def _choice(value: Any) -> ToolChoice:
    if isinstance(value, str):
        if value not in _CHOICES:
            raise invalid_value("tool_choice", "must be auto, none, required or a named function", value)
        return ToolChoice(value)
    if isinstance(value, dict):
        function = value.get("function")
        if value.get("type") == "function" and isinstance(function, dict) and isinstance(function.get("name"), str):
            return ToolChoice("function", function["name"])
    raise invalid_value("tool_choice", 'must be auto, none, required or {"type": "function", '
                                       '"function": {"name": ...}}', value)


_FUNCTION = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": TOOL_NAME.pattern}, "description": {"type": ["string", "null"]},
    "parameters": {"type": ["object", "null"], "description": "A JSON schema of the arguments."}}}
_NAMED_CHOICE = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}

TOOL_FIELDS = (
    Field("tools", "array", "Functions the model may call.", (), parse=_tools,
          schema={"type": "array", "maxItems": MAX_TOOLS, "items": {
              "type": "object", "required": ["function"],
              "properties": {"type": {"const": "function"}, "function": _FUNCTION}}}),
    Field("tool_choice", None, "Whether and which tool the model must call.", ToolChoice(), parse=_choice,
          schema={"anyOf": [{"enum": list(_CHOICES)}, _NAMED_CHOICE]}),
    Field("parallel_tool_calls", "boolean", "Whether one reply may hold several calls.", True),
)
