"""The Response object and its output items, from the choice routes.generate
accumulates (one: the API has no `n`), in the shapes of the openai SDK's
`types/responses` (Response, ResponseReasoningItem, ResponseOutputMessage,
ResponseFunctionToolCall, ResponseUsage)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.engine.tool_parsers import ToolCall
from ruvllm_cli.server.bridge import Choice

STATUSES = ("completed", "incomplete")


def status(choice: Choice) -> str:
    """A finished reply's status: incomplete when the token limit (or the context) cut it."""
    return "incomplete" if choice.finish_reason is FinishReason.LENGTH else "completed"


def usage(choice: Choice) -> dict[str, Any]:
    """OpenAI's counts: `input_tokens` are all the prompt's, `cached_tokens` those the
    prefix cache held; nothing is billed for writing. `reasoning_tokens`: a reasoning
    model's, up to its end marker (0 where that marker is not one token: not counted)."""
    prompt, output = choice.num_prompt_tokens, choice.num_output_tokens
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": choice.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": choice.reasoning_tokens or 0},
            "total_tokens": prompt + output}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def reasoning_id() -> str:
    return f"rs_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, item_status: str) -> dict[str, Any]:
    """A reasoning model's reasoning, as vLLM returns it: the text itself in `content`
    (OpenAI's own models send only a summary, here none)."""
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [reasoning_part(text)],
            "status": item_status}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def call_item_id(call_id: str) -> str:
    """The item id of a call: the parser's random part of its call id (`call_...`) under `fc_`."""
    return "fc_" + call_id.removeprefix("call_")


def message_item(item_id: str, text: str, item_status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": item_status, "role": "assistant",
            "content": [text_part(text)]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, item_status: str) -> dict[str, Any]:
    return {"id": call_item_id(call_id), "type": "function_call", "status": item_status, "call_id": call_id,
            "name": name, "arguments": arguments}


def body_output(choice: Choice, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """A whole reply's items: a reasoning model's reasoning, its text (if any, or if
    there is nothing else), then its calls; the last one takes the reply's status (incomplete where the token limit cut
    it), the others are completed, as the stream closes them."""
    items = [reasoning_item(reasoning_id(), choice.reasoning, "completed")] if choice.reasoning else []
    items += [message_item(message_id(), choice.text, "completed")] if choice.text or not calls else []
    items += [call_item(call.id, call.name, call.arguments, "completed") for call in calls]
    items[-1]["status"] = status(choice)
    return items


@dataclass(frozen=True)
class ResponseHead:
    """What every Response object of one request repeats: its id and time, the model
    and the request's echoed fields (protocol's `echo`)."""

    model: str
    echo: dict[str, Any]
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, choice: Choice | None, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The Response: in progress (no finished `choice` yet), or finished with `output`."""
        state = "in_progress" if choice is None else status(choice)
        incomplete = {"reason": "max_output_tokens"} if state == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": state,
                "background": False, "error": None, "incomplete_details": incomplete, "model": self.model,
                "output": output, "previous_response_id": None, "reasoning": None, "store": False,
                "truncation": "disabled", **self.echo, "usage": usage(choice) if choice is not None else None}


# ---- what /openapi.json says of them ---------------------------------------------------
_STRING = {"type": "string"}
_COUNT = {"type": "integer", "minimum": 0}
_ITEM_STATUS = {"enum": ["completed", "incomplete", "in_progress"]}
MESSAGE_OUTPUT = {"type": "object", "required": ["id", "type", "status", "role", "content"], "properties": {
    "id": _STRING, "type": {"const": "message"}, "status": _ITEM_STATUS, "role": {"const": "assistant"},
    "content": {"type": "array", "items": {"type": "object", "required": ["type", "text", "annotations"],
                                           "properties": {"type": {"const": "output_text"}, "text": _STRING,
                                                          "annotations": {"type": "array", "maxItems": 0}}}}}}
REASONING_OUTPUT = {"type": "object", "required": ["id", "type", "summary"], "properties": {
    "id": _STRING, "type": {"const": "reasoning"}, "status": _ITEM_STATUS, "summary": {"type": "array", "maxItems": 0},
    "content": {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"const": "reasoning_text"}, "text": _STRING}}}}}
CALL_OUTPUT = {"type": "object", "required": ["id", "type", "status", "call_id", "name", "arguments"],
               "properties": {"id": _STRING, "type": {"const": "function_call"}, "status": _ITEM_STATUS,
                              "call_id": _STRING, "name": _STRING, "arguments": _STRING}}
RESPONSE_SCHEMA = {
    "type": "object", "required": ["id", "object", "created_at", "status", "model", "output", "usage",
                                   "parallel_tool_calls", "tool_choice", "tools"],
    "properties": {
        "id": _STRING, "object": {"const": "response"}, "created_at": {"type": "integer"},
        "status": {"enum": list(STATUSES)}, "model": _STRING,
        "incomplete_details": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "reason": {"const": "max_output_tokens"}}}]},
        "output": {"type": "array", "items": {"anyOf": [REASONING_OUTPUT, MESSAGE_OUTPUT, CALL_OUTPUT]}},
        "parallel_tool_calls": {"type": "boolean"}, "tools": {"type": "array"},
        "tool_choice": {"anyOf": [_STRING, {"type": "object"}]}, "store": {"const": False},
        "metadata": {"type": "object", "additionalProperties": _STRING},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"], "properties": {
            "input_tokens": _COUNT, "output_tokens": _COUNT, "total_tokens": _COUNT,
            "input_tokens_details": {"type": "object", "properties": {"cached_tokens": _COUNT}},
            "output_tokens_details": {"type": "object", "properties": {"reasoning_tokens": _COUNT}}}}}}
