"""Chat `messages`: checked and turned into what the chat template takes, each
malformed part a 400 naming its path (`messages[0].content`)."""

from __future__ import annotations

import json
from typing import Any

from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import invalid_type, invalid_value
from ruvllm_cli.server.spec import Field

ROLES = {"system", "developer", "user", "assistant", "tool"}


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid_type("messages", "an array", value)
    if not value:
        raise bad_request("'messages' must contain at least one message.", "messages")
    return [_message(item, f"messages[{i}]") for i, item in enumerate(value)]


def _message(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise invalid_type(where, "an object", item)
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid_value(f"{where}.role", f"must be one of {', '.join(sorted(ROLES))}", role)
    message: dict[str, Any] = {"role": "system" if role == "developer" else role}
    tool_calls = item.get("tool_calls")
    refusal = item.get("refusal") if role == "assistant" else None
    if refusal is not None and not isinstance(refusal, str):
        raise invalid_type(f"{where}.refusal", "a string", refusal)
    content_required = not (role == "assistant" and (tool_calls or refusal))
    message["content"] = _content(item.get("content"), f"{where}.content", content_required,
                                  refusals=role == "assistant")
    if message["content"] is None and refusal:   # an OpenAI reply's refusal, passed back as it came
        message["content"] = refusal
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise invalid_value(f"{where}.tool_calls", "only assistant messages carry an array of tool calls",
                                tool_calls)
        message["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(tool_calls)]
    key = next((key for key in ("reasoning", "reasoning_content") if item.get(key) is not None), None)
    if key is not None:   # a reasoning model's earlier turn (Qwen3's template keeps the last one's)
        if role != "assistant" or not isinstance(item[key], str):
            raise invalid_value(f"{where}.{key}", "only assistant messages carry reasoning, as a string", item[key])
        message["reasoning_content"] = item[key]
    for key in ("name", "tool_call_id"):
        if item.get(key) is not None:
            if not isinstance(item[key], str):
                raise invalid_type(f"{where}.{key}", "a string", item[key])
            message[key] = item[key]
    if role == "tool" and not message.get("tool_call_id"):   # OpenAI's (and vLLM's) required field
        param = f"{where}.tool_call_id"
        raise bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    return message


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """A past tool call for the template. OpenAI sends `arguments` as a JSON string;
    chat templates (Qwen, Llama 3) expect an object they can `tojson` themselves."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid_value(f"{where}.function", "must be an object with a name", function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass   # not JSON: the template gets the text as it came
    return {**call, "function": {**function, "arguments": arguments}}


def _content(value: Any, where: str, required: bool, refusals: bool = False) -> str | None:
    """A string, or text parts joined by newlines (an assistant's `refusal` parts, as
    OpenAI's replies carry them, count as its text); any other part is refused."""
    if value is None:
        if required:
            raise bad_request(f"Missing required parameter: '{where}'.", where, "missing_required_parameter")
        return None
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid_type(where, "a string or an array of content parts", value)
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else part
        key = "refusal" if refusals and kind == "refusal" else "text"
        if kind != key:
            raise invalid_value(f"{where}[{i}].type", "only text content parts are supported", kind)
        if not isinstance(part.get(key), str):
            raise invalid_type(f"{where}[{i}].{key}", "a string", part.get(key))
        texts.append(part[key])
    return "\n".join(texts)


_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
CONTENT_SCHEMA = _CONTENT   # a message's content, for the other APIs' documents (Ollama's)
_PAST_CALL = {"type": "object", "required": ["function"], "properties": {"function": {
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string"}, "arguments": {"type": ["string", "object"]}}}}}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"enum": sorted(ROLES - {"assistant", "tool"})}, "content": _CONTENT, "name": {"type": ["string", "null"]},
    "tool_call_id": {"type": ["string", "null"]}, "tool_calls": {"type": "null"}}}
_TOOL = {"type": "object", "required": ["role", "content", "tool_call_id"], "properties": {
    "role": {"const": "tool"}, "content": _CONTENT, "name": {"type": ["string", "null"]},
    "tool_call_id": {"type": "string", "minLength": 1, "description": "The call this message answers."},
    "tool_calls": {"type": "null"}}}
_REFUSAL_PART = {"type": "object", "required": ["type", "refusal"],
                 "properties": {"type": {"const": "refusal"}, "refusal": {"type": "string"}}}
_ASSISTANT_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART, _REFUSAL_PART]}}]}
_ASSISTANT = {"type": "object", "required": ["role"], "description": "content, or tool_calls, or both.",
              "properties": {"role": {"const": "assistant"},
                             "content": {"anyOf": [_ASSISTANT_CONTENT, {"type": "null"}]},
                             "refusal": {"type": ["string", "null"], "description": "A reply's refusal (its text "
                                         "where content is null)."},
                             "name": {"type": ["string", "null"]},
                             "tool_calls": {"type": ["array", "null"], "items": _PAST_CALL},
                             "reasoning": {"type": ["string", "null"], "description": "A reasoning model's "
                                           "reasoning in that turn (or `reasoning_content`)."},
                             "reasoning_content": {"type": ["string", "null"]}},
              "anyOf": [{"required": ["content"], "properties": {"content": _ASSISTANT_CONTENT}},
                        {"required": ["refusal"], "properties": {"refusal": {"type": "string"}}},
                        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]}
MESSAGES = Field("messages", "array", "The conversation so far.", required=True, parse=parse_messages,
                 schema={"type": "array", "minItems": 1, "items": {"anyOf": [_MESSAGE, _TOOL, _ASSISTANT]}})
