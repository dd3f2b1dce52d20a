"""The Responses API's `input` (a string, or an array of items) as the chat route's
messages for the template: message items with their text parts joined by newlines
(developer is system, as on the chat route), function_call items as the `tool_calls`
of the assistant message before them (or of a new one), function_call_output items
as `tool` messages, reasoning items as the `reasoning_content` of the assistant turn
they open, all in OpenAI's chat form, so every chat template renders them as
it renders a chat request. Each malformed item is a 400 naming its path
(`input[1].content[0].type`)."""

from __future__ import annotations

import json
from typing import Any

from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import invalid_type, invalid_value

# An item's role as the chat template's.
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def parse_input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid_type("input", "a string or an array of input items", value)
    if not value:
        raise bad_request("'input' must contain at least one item.", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        _add_item(messages, item, f"input[{i}]")
    # Reasoning that opened no turn (no message or call after it) belongs to no reply.
    messages = [m for m in messages if not _reasoning_only(m)]
    if not messages:
        raise bad_request("'input' holds no message, call or call output (reasoning items alone open no "
                          "turn).", "input")
    return messages


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise invalid_type(where, "an object (an input item)", item)
    kind = item.get("type") or "message"   # a message may leave its type out
    if kind == "message":
        message = _message(item, where)
        last = messages[-1] if messages else None
        if message["role"] == "assistant" and last is not None and _reasoning_only(last):
            last["content"] = message["content"]   # the turn its reasoning item opened
        else:
            messages.append(message)
    elif kind == "reasoning":
        text = _reasoning(item, where)
        if messages and _reasoning_only(messages[-1]):   # items of one turn's reasoning, in order
            messages[-1]["reasoning_content"] += "\n" + text
        else:
            messages.append({"role": "assistant", "content": None, "reasoning_content": text})
    elif kind == "function_call":
        _add_call(messages, _function_call(item, where))
    elif kind == "function_call_output":
        messages.append(_call_output(item, where))
    elif kind == "item_reference":
        raise invalid_value(f"{where}.type", "this server stores no items (it is stateless): send the item "
                                             "itself, not a reference", kind)
    else:
        raise invalid_value(f"{where}.type", f"must be {', '.join(ITEM_TYPES)} (hosted tools' and other items "
                                             "are not supported)", kind)


def _reasoning_only(message: dict[str, Any]) -> bool:
    return message["role"] == "assistant" and message["content"] is None and "tool_calls" not in message


def _reasoning(item: dict[str, Any], where: str) -> str:
    """A past turn's reasoning: its reasoning_text parts, else its summary's texts
    (encrypted_content, OpenAI's, is not readable here and is dropped)."""
    texts = []
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise invalid_type(f"{where}.{key}", "an array", parts)
        for i, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != kind or not isinstance(part.get("text"), str):
                raise invalid_value(f"{where}.{key}[{i}]", f"must be a {kind} part with its text", part)
            texts.append(part["text"])
        if texts:
            break
    return "\n".join(texts)


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid_value(f"{where}.role", f"must be one of {', '.join(ROLES)}", role)
    content = item.get("content")
    if content is None:
        raise bad_request(f"Missing required parameter: '{where}.content'.", f"{where}.content",
                          "missing_required_parameter")
    return {"role": ROLES[role], "content": _text(content, f"{where}.content", refusals=role == "assistant")}


def _text(content: Any, where: str, refusals: bool = False) -> str:
    """A string, or text parts (input_text, output_text) joined by newlines; an assistant
    message's `refusal` parts (OpenAI's output messages carry them, and clients pass a
    reply's items back as they came) count as its text, as on the chat route."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_type(where, "a string or an array of content parts", content)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid_type(f"{where}[{i}]", "an object (a content part)", part)
        kind = part.get("type")
        key = "refusal" if refusals and kind == "refusal" else "text"
        if key == "text" and kind not in TEXT_PARTS:
            raise invalid_value(f"{where}[{i}].type", "must be input_text or output_text (images, files and audio "
                                                      "are not supported)", kind)
        if not isinstance(part.get(key), str):
            raise invalid_type(f"{where}[{i}].{key}", "a string", part.get(key))
        texts.append(part[key])
    return "\n".join(texts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A past call as the chat route keeps one: its arguments, JSON text in the item,
    as an object the chat templates `tojson` themselves (text that is not JSON stays text)."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise invalid_type(f"{where}.{key}", "a string", item.get(key))
    arguments: Any = item["arguments"]
    try:
        arguments = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        pass
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """Calls join the assistant message just before them: one turn of text and calls,
    as the model wrote it and as a chat request sends it."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise invalid_type(f"{where}.call_id", "a string", item.get("call_id"))
    output = item.get("output")
    if output is None:
        raise bad_request(f"Missing required parameter: '{where}.output'.", f"{where}.output",
                          "missing_required_parameter")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": _text(output, f"{where}.output")}


# ---- what /openapi.json says of them ---------------------------------------------------
_STRING = {"type": "string"}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"enum": list(TEXT_PARTS)}, "text": _STRING}}
_CONTENT = {"anyOf": [_STRING, {"type": "array", "items": _TEXT_PART}]}
MESSAGE_ITEM = {"type": "object", "required": ["role", "content"], "properties": {
    "type": {"const": "message"}, "role": {"enum": list(ROLES)}, "content": _CONTENT}}
FUNCTION_CALL_ITEM = {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
    "type": {"const": "function_call"}, "call_id": _STRING, "name": _STRING,
    "arguments": {"type": "string", "description": "The arguments object as JSON text."}}}
CALL_OUTPUT_ITEM = {"type": "object", "required": ["type", "call_id", "output"], "properties": {
    "type": {"const": "function_call_output"}, "call_id": _STRING, "output": _CONTENT}}
_PARTS = {kind: {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"const": kind}, "text": _STRING}}} for kind in ("reasoning_text", "summary_text")}
REASONING_ITEM = {"type": "object", "required": ["type"], "properties": {
    "type": {"const": "reasoning"}, "content": _PARTS["reasoning_text"], "summary": _PARTS["summary_text"]}}
INPUT_SCHEMA = {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": {
    "anyOf": [MESSAGE_ITEM, FUNCTION_CALL_ITEM, CALL_OUTPUT_ITEM, REASONING_ITEM]}}]}
