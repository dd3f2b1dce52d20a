"""What every tool-call format shares: the result types, and a parser built on one
`scan(text, final)` function per format.

A format's `scan` cuts the text into pieces: plain text, and calls with what each has
shown so far. From those pieces `parse` builds the final reply (a call that is not
complete is given back as its text) and `parse_partial` the streaming view, in which a
call counts from the moment its name is complete, since that is when a stream
announces it.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol, Union

from ruvllm_cli.engine.tool_parsers.json_scan import CallObject, State

_ALPHANUMERICS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it; "{}" when it wrote none


@dataclass(frozen=True)
class ParsedReply:
    content: str  # text outside the calls, stripped of surrounding whitespace; "" if none
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI streaming fragment of one call."""

    index: int        # the call's position in this reply
    id: str | None    # first fragment of a call only
    name: str | None  # first fragment of a call only
    arguments: str    # "" on the first fragment; concatenated they equal ToolCall.arguments


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class PartialCall:
    """A call as far as the text shows it; every field only ever grows."""

    name: str
    arguments: str        # argument text that can no longer change
    id: str | None        # an id the model wrote, once complete
    done: bool            # the arguments are final


@dataclass(frozen=True)
class PartialReply:
    """The streaming view of a text that may still grow."""

    content: str                      # content text that can no longer change (whitespace not yet stripped)
    tool_calls: tuple[PartialCall, ...]


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class CallPiece:
    state: State
    raw: str                 # the call's own text, markers included: content if it never becomes a call
    name: str | None = None
    call_id: str | None = None
    arguments: str = ""

    @classmethod
    def of(cls, found: CallObject, raw: str) -> CallPiece:
        return cls(found.state, raw, found.name, found.call_id, found.arguments)


Piece = Union[TextPiece, CallPiece]


class ToolParser(Protocol):
    """One tool-call format."""

    name: str
    start_markers: tuple[str, ...]
    markers: tuple[str, ...]   # every marker the format writes, kept in the text as special tokens
    opening: str               # a regular expression: where the reply's first call opens

    def parse(self, text: str) -> ParsedReply: ...

    def parse_partial(self, text: str, final: bool = False) -> PartialReply: ...

    def new_call_id(self) -> str: ...


class ScanningParser:
    """A `ToolParser` from a format's `scan`. `scan(text, final)` returns the pieces
    that can no longer change; when `final` is false it leaves out a tail that could
    still turn into a marker or finish a call, and a call never outlives its piece."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]]
    markers: ClassVar[tuple[str, ...]]
    opening: ClassVar[str]
    id_length: ClassVar[int] = 24
    id_prefix: ClassVar[str] = "call_"
    scan: ClassVar[Callable[[str, bool], list[Piece]]]

    def parse(self, text: str) -> ParsedReply:
        """The whole reply: complete calls, and everything else (a broken or
        unfinished call included, markers and all) as content. Never raises."""
        content: list[str] = []
        calls: list[ToolCall] = []
        for piece in self.scan(text, True):
            if isinstance(piece, CallPiece) and piece.state is State.COMPLETE:
                calls.append(ToolCall(piece.call_id or self.new_call_id(), piece.name, piece.arguments))
            else:
                content.append(piece.text if isinstance(piece, TextPiece) else piece.raw)
        return ParsedReply("".join(content).strip(), calls)

    def parse_partial(self, text: str, final: bool = False) -> PartialReply:
        """What a stream may send of `text`. A call counts once its name is complete
        and stays a call even if it breaks later (its arguments stop where the text
        went wrong); a call that broke before its name is content, and so is one still
        nameless at the end (`final`) unless it opened with one of the format's markers
        (special tokens, never text): then the reply was cut inside the call's opening,
        which is dropped rather than shown as markup. Each field only grows as `text`
        grows."""
        content: list[str] = []
        calls: list[PartialCall] = []
        for piece in self.scan(text, final):
            if isinstance(piece, TextPiece):
                content.append(piece.text)
            elif piece.name is not None:
                calls.append(PartialCall(piece.name, piece.arguments, piece.call_id, piece.state is not State.OPEN))
            elif piece.state is State.BROKEN or (final and not piece.raw.lstrip().startswith(self.markers)):
                content.append(piece.raw)
        return PartialReply("".join(content), tuple(calls))

    def new_call_id(self) -> str:
        return self.id_prefix + "".join(secrets.choice(_ALPHANUMERICS) for _ in range(self.id_length))


def held_marker_length(text: str, markers: tuple[str, ...], start: int = 0) -> int:
    """How long a tail of `text[start:]` could still grow into one of `markers`."""
    longest = min(max(len(m) for m in markers) - 1, len(text) - start)
    for size in range(longest, 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0


def text_until_marker(text: str, start: int, markers: tuple[str, ...], final: bool) -> TextPiece:
    """Plain text from `start` to the end, less a tail that could become a marker."""
    end = len(text) if final else len(text) - held_marker_length(text, markers, start)
    return TextPiece(text[start:end])
