"""Anthropic's message body and stream events, from the choices routes.generate
accumulates for every endpoint (one choice: the API has no `n`).

A stream is Anthropic's sequence: message_start, then per content block
content_block_start, its deltas (thinking_delta for a thinking block, text_delta,
or input_json_delta for a tool_use block) and content_block_stop, then message_delta (stop_reason, usage) and
message_stop; an error cuts it short with an `error` event. message_start waits
for the first output, which brings the prompt's cached-token count."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.engine.tool_parsers import StreamDelta, ToolCall, ToolCallDelta
from ruvllm_cli.server.bridge import Choice
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.messages_api.errors import anthropic_error_body
from ruvllm_cli.server.sse import Chunk, Event
from ruvllm_cli.server.tool_output import ToolReplies, arguments_object, in_text_order

STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use")


def stop_reason(choice: Choice) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if choice.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if choice.finish_reason is not FinishReason.STOP:
        return None, None
    if choice.tool_calls:
        return "tool_use", None
    if choice.stop_string is not None:
        return "stop_sequence", choice.stop_string
    return "end_turn", None


def usage(choice: Choice) -> dict[str, int]:
    """Anthropic's counts: `input_tokens` are the prompt tokens the prefix cache did
    not hold, `cache_read_input_tokens` those it did (nothing is billed for writing)."""
    cached = choice.num_cached_tokens
    return {"input_tokens": choice.num_prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": choice.num_output_tokens}


def tool_use_id(call_id: str) -> str:
    """Anthropic's id prefix for the parser's ids (`call_...`), the same in a body and a stream."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """A call's `input` is an object always (tool_output.arguments_object), also where
    max_tokens cut it (stop_reason "max_tokens")."""
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": arguments_object(call.arguments)}


def event(data: dict[str, Any]) -> Event:
    return Event(data, data["type"])


@dataclass
class Blocks:
    """What a stream has opened: each event names its block's index, and a block's
    deltas must come before the next block starts."""

    started: bool = False          # message_start sent
    count: int = 0                 # blocks started
    open: str | None = None        # the open block's type
    calls: dict[int, int] = field(default_factory=dict)   # tool-call index -> its block's index

    def start(self, block: dict[str, Any]) -> list[Chunk]:
        chunks = self.stop()
        self.open, self.count = block["type"], self.count + 1
        return [*chunks, event({"type": "content_block_start", "index": self.count - 1, "content_block": block})]

    def stop(self) -> list[Chunk]:
        if self.open is None:
            return []
        self.open = None
        return [event({"type": "content_block_stop", "index": self.count - 1})]

    def thinking(self, text: str) -> list[Chunk]:
        # signature: Anthropic's check that it wrote the thinking, which a local model has none of
        chunks = self.start({"type": "thinking", "thinking": "", "signature": ""}) if self.open != "thinking" else []
        return [*chunks, _delta(self.count - 1, {"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[Chunk]:
        chunks = self.start({"type": "text", "text": ""}) if self.open != "text" else []
        return [*chunks, _delta(self.count - 1, {"type": "text_delta", "text": text})]

    def call(self, fragment: ToolCallDelta) -> list[Chunk]:
        chunks: list[Chunk] = []
        if fragment.index not in self.calls:
            assert fragment.id is not None and fragment.name is not None, "a call's first fragment names it"
            chunks = self.start({"type": "tool_use", "id": tool_use_id(fragment.id), "name": fragment.name,
                                 "input": {}})
            self.calls[fragment.index] = self.count - 1
        if fragment.arguments:
            chunks.append(_delta(self.calls[fragment.index], {"type": "input_json_delta",
                                                              "partial_json": fragment.arguments}))
        return chunks

    def parsed(self, delta: StreamDelta) -> list[Chunk]:
        """A tool parser's step in text order (tool_output.in_text_order)."""
        return in_text_order(delta, self.calls, self.text, self.call)


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return event({"type": "content_block_delta", "index": index, "delta": delta})


@dataclass
class MessagesFormat:
    """routes.ResponseFormat for Anthropic's Messages API."""

    model: str
    tools: ToolReplies | None = None   # the model may call tools: parse its replies
    thinking: bool = False             # a reasoning model's reasoning as a thinking block (`thinking` asked)
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    _blocks: dict[int, Blocks] = field(default_factory=dict)

    def body(self, choices: Sequence[Choice]) -> dict[str, Any]:
        [choice] = choices
        if self.tools is not None:
            self.tools.settle(choice)
        content = [{"type": "text", "text": choice.text}] if choice.text else []
        if self.thinking and choice.reasoning:
            content.insert(0, {"type": "thinking", "thinking": choice.reasoning, "signature": ""})
        return self._message(choice, content + [tool_use_block(call) for call in choice.tool_calls])

    def _message(self, choice: Choice, content: list[dict[str, Any]]) -> dict[str, Any]:
        reason, sequence = stop_reason(choice)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage(choice)}

    def opening(self, choice: Choice) -> list[Chunk]:
        return []   # message_start comes with the first output (see the module's docstring)

    def reasoning(self, choice: Choice, text: str) -> list[Chunk]:
        return [*self._start(choice), *self._blocks[choice.index].thinking(text)] if self.thinking else []

    def deltas(self, choice: Choice, output: RequestOutput) -> list[Chunk]:
        chunks = self._start(choice)
        blocks = self._blocks[choice.index]
        if self.tools is not None:
            return chunks + blocks.parsed(self.tools.feed(choice, output.text))
        return chunks + (blocks.text(output.text) if output.text else [])

    def flush(self, choice: Choice) -> list[Chunk]:
        chunks = self._start(choice)
        blocks = self._blocks[choice.index]
        if self.tools is not None:
            chunks += blocks.parsed(self.tools.finish(choice))
        return chunks + blocks.stop()

    def final(self, choice: Choice) -> Chunk:
        reason, sequence = stop_reason(choice)
        return event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                      "usage": usage(choice)})

    def closing(self, choices: Sequence[Choice]) -> list[Chunk]:
        return [event({"type": "message_stop"})]

    def error_chunks(self, error: ApiError) -> list[Chunk]:
        return [event(anthropic_error_body(error))]

    def _start(self, choice: Choice) -> list[Chunk]:
        blocks = self._blocks.setdefault(choice.index, Blocks())
        if blocks.started:
            return []
        blocks.started = True
        message = {**self._message(choice, []), "stop_reason": None, "stop_sequence": None}
        return [event({"type": "message_start", "message": message})]
