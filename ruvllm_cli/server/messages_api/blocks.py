"""Anthropic's `system` and `messages` (strings or content blocks) as the chat route's
messages for the template: text blocks joined by newlines, an assistant's tool_use
blocks as its `tool_calls`, a user's tool_result blocks as `tool` messages, all in
OpenAI's form, so every chat template renders them as it renders a chat request.
Each malformed part is a 400 naming its path (`messages[1].content[0].type`)."""

from __future__ import annotations

from typing import Any

from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import invalid_type, invalid_value

ROLES = ("user", "assistant")
# The blocks each role may send; images, documents and server-tool blocks are refused. An
# assistant's thinking goes to the template as its reasoning (Qwen3's drops it from
# earlier turns); redacted thinking, encrypted by Anthropic, is dropped.
BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


def parse_system(value: Any) -> str:
    """A string, or text blocks (their `cache_control` ignored: caching is automatic here)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid_type("system", "a string or an array of text blocks", value)
    return "\n".join(_text(block, f"system[{i}]") for i, block in enumerate(value))


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid_type("messages", "an array", value)
    if not value:
        raise bad_request("'messages' must contain at least one message.", "messages")
    messages = [m for i, item in enumerate(value) for m in _turn(item, f"messages[{i}]")]
    if value[-1]["role"] == "assistant":
        # Anthropic's "prefill": the reply would continue this text, which the chat
        # template cannot express (it closes the assistant's turn).
        raise invalid_value(f"messages[{len(value) - 1}].role", "the last message must be the user's (a final "
                                                                "assistant message, a prefill, is not supported)",
                            "assistant")
    return messages


def _turn(item: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as one or more chat messages."""
    if not isinstance(item, dict):
        raise invalid_type(where, "an object", item)
    role = item.get("role")
    if role not in ROLES:
        raise invalid_value(f"{where}.role", "must be user or assistant", role)
    content = item.get("content")
    if content is None:
        raise bad_request(f"Missing required parameter: '{where}.content'.", f"{where}.content",
                          "missing_required_parameter")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid_type(f"{where}.content", "a string or an array of content blocks", content)
    paths = [f"{where}.content[{j}]" for j in range(len(content))]
    kinds = [_kind(block, path, BLOCKS[role]) for block, path in zip(content, paths)]
    blocks = list(zip(kinds, content, paths))
    return [_assistant(blocks)] if role == "assistant" else _user(blocks)


def _kind(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict):
        raise invalid_type(where, "an object (a content block)", block)
    kind = block.get("type")
    if kind not in allowed:
        raise invalid_value(f"{where}.type", f"must be {' or '.join(allowed)} in this role (image, document and "
                                             "other blocks are not supported)", kind)
    return str(kind)


def _user(blocks: list[tuple[str, Any, str]]) -> list[dict[str, Any]]:
    """Text runs as user messages and each tool_result as a `tool` message, in order."""
    messages: list[dict[str, Any]] = []
    texts: list[str] = []
    for kind, block, where in blocks:
        if kind == "text":
            texts.append(_text(block, where))
            continue
        if texts:
            messages.append({"role": "user", "content": "\n".join(texts)})
            texts = []
        messages.append(_tool_result(block, where))
    if texts or not messages:
        messages.append({"role": "user", "content": "\n".join(texts)})
    return messages


def _assistant(blocks: list[tuple[str, Any, str]]) -> dict[str, Any]:
    texts = [_text(block, where) for kind, block, where in blocks if kind == "text"]
    calls = [_tool_use(block, where) for kind, block, where in blocks if kind == "tool_use"]
    thinking = [_thinking(block, where) for kind, block, where in blocks if kind == "thinking"]
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _thinking(block: dict[str, Any], where: str) -> str:
    """A past turn's thinking (its `signature`, Anthropic's, is not checked here)."""
    if not isinstance(block.get("thinking"), str):
        raise invalid_type(f"{where}.thinking", "a string", block.get("thinking"))
    return str(block["thinking"])


def _text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else block
        raise invalid_value(f"{where}.type", "must be text", kind)
    if not isinstance(block.get("text"), str):
        raise invalid_type(f"{where}.text", "a string", block.get("text"))
    return str(block["text"])


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A past call, as the chat route keeps one: arguments as an object for the template."""
    for key in ("id", "name"):
        if not isinstance(block.get(key), str):
            raise invalid_type(f"{where}.{key}", "a string", block.get(key))
    if not isinstance(block.get("input"), dict):
        raise invalid_type(f"{where}.input", "an object", block.get("input"))
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": block["input"]}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A `tool` message. `is_error` is accepted, but the template only sees the text."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise invalid_type(f"{where}.tool_use_id", "a string", call_id)
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        text = "\n".join(_text(part, f"{where}.content[{k}]") for k, part in enumerate(content))
    else:
        raise invalid_type(f"{where}.content", "a string or an array of text blocks", content)
    return {"role": "tool", "tool_call_id": call_id, "content": text}


# ---- what /openapi.json says of them ---------------------------------------------------
TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TEXTS = {"type": "array", "items": TEXT_BLOCK}
TOOL_USE_BLOCK = {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
    "type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"},
    "input": {"type": "object"}}}
THINKING_BLOCK = {"type": "object", "required": ["type", "thinking"], "properties": {
    "type": {"const": "thinking"}, "thinking": {"type": "string"}, "signature": {"type": "string"}}}
_REDACTED = {"type": "object", "required": ["type"], "properties": {"type": {"const": "redacted_thinking"}}}
_TOOL_RESULT = {"type": "object", "required": ["type", "tool_use_id"], "properties": {
    "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"},
    "content": {"anyOf": [{"type": "string"}, _TEXTS, {"type": "null"}]},
    "is_error": {"type": ["boolean", "null"]}}}


def _turn_schema(role: str, blocks: list[Any]) -> dict[str, Any]:
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": blocks}}]}
    return {"type": "object", "required": ["role", "content"],
            "properties": {"role": {"const": role}, "content": content}}


SYSTEM_SCHEMA = {"anyOf": [{"type": "string"}, _TEXTS]}
MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "description": "The last message is the user's.",
                   "items": {"anyOf": [_turn_schema("user", [TEXT_BLOCK, _TOOL_RESULT]),
                                       _turn_schema("assistant", [TEXT_BLOCK, TOOL_USE_BLOCK, THINKING_BLOCK,
                                                                  _REDACTED])]}}
