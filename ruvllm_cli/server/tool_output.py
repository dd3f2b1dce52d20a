"""Tool calls in chat responses: each choice's text parsed by the model family's
parser, whole (`settle`) or as it streams (`feed` / `finish`), into OpenAI's shape;
a reply comes out the same either way."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Sequence, TypeVar

from ruvllm_cli.engine.tool_parsers import (StreamDelta, StreamingToolParser, ToolCall, ToolCallDelta,
                                            ToolParser)
from ruvllm_cli.engine.tools import ToolRequest
from ruvllm_cli.server.bridge import Choice

Item = TypeVar("Item")


def in_text_order(delta: StreamDelta, open_calls: Container[int], text: Callable[[str], list[Item]],
                  call: Callable[[ToolCallDelta], list[Item]]) -> list[Item]:
    """A tool parser's step as a stream's events, in text order: the open calls'
    argument text comes before any content in the same step, and new calls after it
    (the Anthropic and Responses streams, whose blocks open and close in order)."""
    going = [f for f in delta.tool_calls if f.index in open_calls]
    new = [f for f in delta.tool_calls if f.index not in open_calls]
    events = [e for f in going for e in call(f)]
    events += text(delta.content) if delta.content else []
    return events + [e for f in new for e in call(f)]


@dataclass
class ToolReplies:
    """The parsing state of one response's choices. `forced` (tool_choice required or
    a named function): the reply is calls only, so no text of it is content, even a
    call cut by max_tokens before its name came out (its markup had been content)."""

    parser: ToolParser
    forced: bool = False
    parallel: bool = True   # False (parallel_tool_calls): a reply's first call only, as OpenAI answers
    _streams: dict[int, StreamingToolParser] = field(default_factory=dict)

    @classmethod
    def of(cls, parser: ToolParser | None, tools: ToolRequest | None) -> "ToolReplies | None":
        if parser is None:
            return None
        return cls(parser, forced=tools is not None and tools.choice.forced,
                   parallel=tools is None or tools.parallel)

    def settle(self, choice: Choice) -> None:
        """A whole reply, as the same reply streamed ends: a call whose name came out
        is a call, with its arguments as far as the model wrote them (so not valid JSON
        where max_tokens cut it, finish_reason "length", or the model broke it: OpenAI
        answers a cut-off call so too); a call that never got its name out is content,
        or nothing where it opened with a marker (`parse_partial`). `parse` gave such calls back as content, markup and all, where the
        stream had sent them as calls."""
        reply = self.parser.parse_partial(choice.text, final=True)
        choice.text = "" if self.forced else reply.content.strip()
        calls = reply.tool_calls if self.parallel else reply.tool_calls[:1]
        choice.tool_calls = [ToolCall(call.id or self.parser.new_call_id(), call.name, call.arguments)
                             for call in calls]

    def feed(self, choice: Choice, text: str) -> StreamDelta:
        return self._calls_only(self._stream(choice).feed(text)) if text else StreamDelta()

    def finish(self, choice: Choice) -> StreamDelta:
        stream = self._stream(choice)
        tail = stream.finish()
        choice.tool_calls = list(stream.calls) if self.parallel else list(stream.calls)[:1]
        return self._calls_only(tail)

    def _calls_only(self, delta: StreamDelta) -> StreamDelta:
        if not self.parallel and any(f.index > 0 for f in delta.tool_calls):
            delta = StreamDelta(delta.content, tuple(f for f in delta.tool_calls if f.index == 0))
        return StreamDelta(tool_calls=delta.tool_calls) if self.forced and delta.content else delta

    def _stream(self, choice: Choice) -> StreamingToolParser:
        if choice.index not in self._streams:
            self._streams[choice.index] = StreamingToolParser(self.parser)
        return self._streams[choice.index]


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object, for the APIs that send them so (Anthropic's
    `input`, Ollama's `arguments`). A complete call's are a JSON object
    (tool_parsers.json_scan); one that max_tokens cut has them as far as the model
    wrote them, and gets what json-repair makes of that: an object always, as a
    client's own parse of the streamed text gives one."""
    try:
        value = json.loads(arguments)
    except ValueError:
        import json_repair

        value = json_repair.repair_json(arguments, return_objects=True)
    return value if isinstance(value, dict) else {}


def complete_call(arguments: str) -> bool:
    """Whether a call's arguments are whole: a complete call's are a JSON object
    (tool_parsers.json_scan); a cut or broken one's are text as far as it went."""
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def calls_json(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def delta_json(delta: StreamDelta) -> list[dict[str, Any]]:
    """chat.completion.chunk `delta`s: content and tool-call fragments, one chunk per
    fragment of the same call (a call's first fragment must stay id + name + "")."""
    deltas: list[dict[str, Any]] = [{"content": delta.content}] if delta.content else []
    for fragment in delta.tool_calls:
        current = deltas[-1] if deltas else None
        indexes = [f["index"] for f in current.get("tool_calls", [])] if current is not None else []
        if current is None or fragment.index in indexes:
            current = {}
            deltas.append(current)
        current.setdefault("tool_calls", []).append(_fragment(fragment))
    return deltas


def _fragment(delta: ToolCallDelta) -> dict[str, Any]:
    fragment: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        fragment.update(id=delta.id, type="function")
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.name is not None:
        function["name"] = delta.name
    fragment["function"] = function
    return fragment
