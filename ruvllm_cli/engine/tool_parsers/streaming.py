"""Tool calls out of a stream of decoded text, in OpenAI's streaming shape.

The whole text so far is kept and re-parsed after every step (`parse_partial`); what
is new since the last step is sent. The parser only reports what can no longer
change, so nothing sent is ever taken back: a tail that could still become a marker
is held, a call is announced once its name is complete, and its argument text is
sent as it arrives (the model's own text, up to where the arguments object is known
to go on).
"""

from __future__ import annotations

from dataclasses import dataclass

from ruvllm_cli.engine.tool_parsers.base import (
    PartialCall, PartialReply, StreamDelta, ToolCall, ToolCallDelta, ToolParser,
)


@dataclass
class _SentCall:
    id: str
    name: str
    arguments: str = ""


class StreamingToolParser:
    """Feed decoded text, get content and tool-call fragments to send.

    Content is the text outside the calls with surrounding whitespace stripped, as
    `parse` gives it (trailing whitespace waits until more content follows it).
    At `finish` a call that never got its name out is sent as content (unless it
    opened with a marker: `ScanningParser.parse_partial` drops it); one already
    announced keeps the arguments it has (the model's text as far as it went, so
    possibly not valid JSON when the reply was cut off or broke inside the call).
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content = ""  # all content sent so far
        self._calls: list[_SentCall] = []

    def feed(self, delta: str) -> StreamDelta:
        """New decoded text (any number of characters, cut anywhere)."""
        self.text += delta
        return self._advance(self.parser.parse_partial(self.text))

    def finish(self) -> StreamDelta:
        """The end of the reply: what was held back."""
        return self._advance(self.parser.parse_partial(self.text, final=True))

    @property
    def calls(self) -> list[ToolCall]:
        """The calls sent so far, with the argument text sent so far."""
        return [ToolCall(call.id, call.name, call.arguments) for call in self._calls]

    def _advance(self, reply: PartialReply) -> StreamDelta:
        content = self._content_delta(reply.content)
        fragments: list[ToolCallDelta] = []
        for index, call in enumerate(reply.tool_calls):
            fragments.extend(self._call_deltas(index, call))
        return StreamDelta(content, tuple(fragments))

    def _content_delta(self, content: str) -> str:
        safe = content.strip()
        assert safe.startswith(self.content), "a tool parser took back content"
        delta, self.content = safe[len(self.content):], safe
        return delta

    def _call_deltas(self, index: int, call: PartialCall) -> list[ToolCallDelta]:
        fragments = []
        if index == len(self._calls):
            self._calls.append(_SentCall(call.id or self.parser.new_call_id(), call.name))
            fragments.append(ToolCallDelta(index, self._calls[index].id, call.name, ""))
        sent = self._calls[index]
        if len(call.arguments) > len(sent.arguments):
            assert call.arguments.startswith(sent.arguments), "a tool parser took back arguments"
            fragments.append(ToolCallDelta(index, None, None, call.arguments[len(sent.arguments):]))
            sent.arguments = call.arguments
        return fragments
