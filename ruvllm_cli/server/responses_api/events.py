"""The Responses API's answers: a Response object, or its stream of named events.

A stream is OpenAI's sequence: response.created and response.in_progress, then per
output item response.output_item.added, its content (a reasoning item's
response.reasoning_text.delta... and .done; a message's
response.content_part.added, response.output_text.delta..., response.output_text.done
and response.content_part.done; a call's response.function_call_arguments.delta...
and .done) and response.output_item.done, then response.completed (or
response.incomplete when the token limit cut the reply); an error cuts it short with
an `error` event. Every event carries its `sequence_number`. The last event's Response
holds the items as they were streamed (same ids), so the SDK's stream helper finds
them whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.tool_parsers import StreamDelta, ToolCallDelta
from ruvllm_cli.server.bridge import Choice
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.responses_api.output import (ResponseHead, body_output, call_item, call_item_id, message_id,
                                                    message_item, reasoning_id, reasoning_item,
                                                    status, text_part)
from ruvllm_cli.server.sse import Chunk, Event
from ruvllm_cli.server.tool_output import ToolReplies, in_text_order


@dataclass
class Item:
    """One output item as far as it has streamed: reasoning or a message's text, or a
    call's arguments."""

    id: str
    call_id: str | None = None    # None: a message, or reasoning
    name: str = ""
    text: str = ""
    status: str = "in_progress"
    reasoning: bool = False

    def json(self) -> dict[str, Any]:
        if self.reasoning:
            return reasoning_item(self.id, self.text, self.status)
        if self.call_id is None:
            return message_item(self.id, self.text, self.status)
        return call_item(self.call_id, self.name, self.text, self.status)

    def added(self) -> dict[str, Any]:
        """The item as response.output_item.added shows it: nothing in it yet."""
        return {**self.json(), "content": []} if self.call_id is None else self.json()


@dataclass
class OutputStream:
    """What a stream has opened, and its events' numbering: each event names its
    item's output_index, and an item's content comes before the next item opens."""

    items: list[Item] = field(default_factory=list)
    sequence: int = 0
    open: int | None = None                                # the open item's output_index
    calls: dict[int, int] = field(default_factory=dict)    # tool-call index -> its item's output_index

    def event(self, kind: str, **data: Any) -> Event:
        chunk = Event({"type": kind, **data, "sequence_number": self.sequence}, kind)
        self.sequence += 1
        return chunk

    def output(self) -> list[dict[str, Any]]:
        return [item.json() for item in self.items]

    def reasoning(self, text: str) -> list[Chunk]:
        chunks: list[Chunk] = []
        if self.open is None or not self.items[self.open].reasoning:
            chunks = self._start(Item(reasoning_id(), reasoning=True))
        self._open_item().text += text
        chunks.append(self._on_open("response.reasoning_text.delta", content_index=0, delta=text))
        return chunks

    def text(self, text: str) -> list[Chunk]:
        """Message text; an empty `text` only opens the message."""
        chunks: list[Chunk] = []
        if self.open is None or self.items[self.open].call_id is not None or self.items[self.open].reasoning:
            chunks = self._start(Item(message_id()))
            chunks.append(self._on_open("response.content_part.added", content_index=0, part=text_part("")))
        if text:
            self._open_item().text += text
            chunks.append(self._on_open("response.output_text.delta", content_index=0, delta=text, logprobs=[]))
        return chunks

    def call(self, fragment: ToolCallDelta) -> list[Chunk]:
        chunks: list[Chunk] = []
        if fragment.index not in self.calls:
            assert fragment.id is not None and fragment.name is not None, "a call's first fragment names it"
            chunks = self._start(Item(call_item_id(fragment.id), fragment.id, fragment.name))
            self.calls[fragment.index] = len(self.items) - 1
        if fragment.arguments:
            index = self.calls[fragment.index]
            item = self.items[index]
            item.text += fragment.arguments
            chunks.append(self.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                     delta=fragment.arguments))
        return chunks

    def parsed(self, delta: StreamDelta) -> list[Chunk]:
        """A tool parser's step in text order (tool_output.in_text_order)."""
        return in_text_order(delta, self.calls, self.text, self.call)

    def close(self, item_status: str) -> list[Chunk]:
        """The open item's done events, with `item_status` its final status."""
        if self.open is None:
            return []
        item = self._open_item()
        item.status = item_status
        if item.reasoning:
            chunks = [self._on_open("response.reasoning_text.done", content_index=0, text=item.text)]
        elif item.call_id is None:
            chunks = [self._on_open("response.output_text.done", content_index=0, text=item.text, logprobs=[]),
                      self._on_open("response.content_part.done", content_index=0, part=text_part(item.text))]
        else:
            chunks = [self._on_open("response.function_call_arguments.done", arguments=item.text)]
        chunks.append(self.event("response.output_item.done", output_index=self.open, item=item.json()))
        self.open = None
        return chunks

    def _start(self, item: Item) -> list[Chunk]:
        chunks = self.close("completed")
        self.items.append(item)
        self.open = len(self.items) - 1
        return [*chunks, self.event("response.output_item.added", output_index=self.open, item=item.added())]

    def _open_item(self) -> Item:
        assert self.open is not None, "no item is open"
        return self.items[self.open]

    def _on_open(self, kind: str, **data: Any) -> Event:
        """An event of the open item's content."""
        return self.event(kind, item_id=self._open_item().id, output_index=self.open, **data)


@dataclass
class ResponsesFormat:
    """routes.ResponseFormat for OpenAI's Responses API."""

    head: ResponseHead
    tools: ToolReplies | None = None   # the model may call tools: parse its replies
    _stream: OutputStream = field(default_factory=OutputStream)

    def body(self, choices: Sequence[Choice]) -> dict[str, Any]:
        [choice] = choices
        if self.tools is not None:
            self.tools.settle(choice)
        return self.head.response(choice, body_output(choice, choice.tool_calls))

    def opening(self, choice: Choice) -> list[Chunk]:
        response = self.head.response(None, [])
        return [self._stream.event("response.created", response=response),
                self._stream.event("response.in_progress", response=response)]

    def reasoning(self, choice: Choice, text: str) -> list[Chunk]:
        return self._stream.reasoning(text)

    def deltas(self, choice: Choice, output: RequestOutput) -> list[Chunk]:
        if self.tools is not None:
            return self._stream.parsed(self.tools.feed(choice, output.text))
        return self._stream.text(output.text) if output.text else []

    def flush(self, choice: Choice) -> list[Chunk]:
        chunks = self._stream.parsed(self.tools.finish(choice)) if self.tools is not None else []
        if not any(not item.reasoning for item in self._stream.items):
            chunks += self._stream.text("")   # an empty message, as the body has one
        return chunks + self._stream.close(status(choice))

    def final(self, choice: Choice) -> Chunk:
        state = status(choice)
        kind = "response.incomplete" if state == "incomplete" else "response.completed"
        return self._stream.event(kind, response=self.head.response(choice, self._stream.output()))

    def closing(self, choices: Sequence[Choice]) -> list[Chunk]:
        return []   # the stream ends with response.completed (no [DONE])

    def error_chunks(self, error: ApiError) -> list[Chunk]:
        return [self._stream.event("error", code=error.code, message=error.message, param=error.param)]
