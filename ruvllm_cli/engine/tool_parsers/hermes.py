"""Hermes / Qwen2.5 tool calls: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`,
any number of them, with text before, between and after (all of it content).

The markers are ordinary decoded text. A block whose JSON is complete but whose
`</tool_call>` never came (end of reply, or other text straight after) still counts.
A block that is not a call is content, markers included, up to its `</tool_call>` or
the next `<tool_call>`; marker text inside JSON strings is just string text.
"""

from __future__ import annotations

import re

from ruvllm_cli.engine.tool_parsers.base import CallPiece, Piece, ScanningParser, TextPiece, text_until_marker
from ruvllm_cli.engine.tool_parsers.json_scan import CallObject, State, scan_call_object, skip_ws

NAME = "hermes"
START = "<tool_call>"
END = "</tool_call>"
START_MARKERS = (START,)
ARGUMENT_KEYS = ("arguments", "parameters")


def scan(text: str, final: bool) -> list[Piece]:
    pieces: list[Piece] = []
    pos: int | None = 0
    while pos is not None:
        start = text.find(START, pos)
        if start < 0:
            pieces.append(text_until_marker(text, pos, START_MARKERS, final))
            break
        pieces.append(TextPiece(text[pos:start]))
        call, pos = _scan_block(text, start, final)
        pieces.append(call)
    return pieces


def _scan_block(text: str, start: int, final: bool) -> tuple[CallPiece, int | None]:
    """One block from its start marker: the call, and where the text after it starts
    (None when the block may still run on to the end of the text)."""
    body = skip_ws(text, start + len(START))
    if body == len(text):
        return CallPiece(State.OPEN, text[start:]), None
    if text[body] != "{":
        return _broken_block(text, start, body, None, final)
    found = scan_call_object(text, body, ARGUMENT_KEYS)
    if found.state is State.OPEN:
        return CallPiece.of(found, text[start:]), None
    if found.state is State.BROKEN:
        return _broken_block(text, start, found.end, found, final)
    after = skip_ws(text, found.end)
    if text.startswith(END, after):
        end: int | None = after + len(END)
    elif END.startswith(text[after:]):  # nothing or part of the end marker: wait, or take it at the end
        end = len(text) if final else None
    else:
        end = found.end  # the end marker never came; what follows is text again
    return CallPiece.of(found, text[start:end]), end


def _broken_block(
    text: str, start: int, bad: int, found: CallObject | None, final: bool
) -> tuple[CallPiece, int | None]:
    """A block that can never be a call runs from its start marker to after the next
    end marker or up to the next start marker (searched from where it went wrong);
    until one comes, as far as the text cannot still become a start marker."""
    end = _broken_block_end(text, bad)
    if end is None and final:
        end = len(text)
    raw = text[start:end] if end is not None else text_until_marker(text, start, START_MARKERS, False).text
    if found is None:
        return CallPiece(State.BROKEN, raw), end
    return CallPiece.of(found, raw), end


def _broken_block_end(text: str, bad: int) -> int | None:
    closing, next_start = text.find(END, bad), text.find(START, bad)
    ends = ([closing + len(END)] if closing >= 0 else []) + ([next_start] if next_start >= 0 else [])
    return min(ends, default=None)


class Parser(ScanningParser):
    name = NAME
    start_markers = START_MARKERS
    markers = (START, END)
    opening = re.escape(START)
    scan = staticmethod(scan)
