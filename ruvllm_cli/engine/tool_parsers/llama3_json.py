"""Llama 3.1 / 3.2 JSON tool calls: the reply is `{"name": "f", "parameters": {...}}`
("arguments" also accepted), optionally after `<|python_tag|>`, several separated by
`;` (or only by whitespace). A reply that does not start (after whitespace and the
tag) with `{` is content.

Text after the last call is content. Nothing is read after a call that is not one:
from its `{` on, the rest of the reply is content (or, in a stream that already
announced the call, is dropped).
"""

from __future__ import annotations

import re

from ruvllm_cli.engine.tool_parsers.base import CallPiece, Piece, ScanningParser, TextPiece
from ruvllm_cli.engine.tool_parsers.json_scan import State, scan_call_object, skip_ws

NAME = "llama3_json"
PYTHON_TAG = "<|python_tag|>"
START_MARKERS = (PYTHON_TAG, "{")  # "{" only at the start of the reply
ARGUMENT_KEYS = ("parameters", "arguments")


def scan(text: str, final: bool) -> list[Piece]:
    first = _first_call(text, final)
    if first is None:
        return []
    if first == len(text) or text[first] != "{":
        return [TextPiece(text)]
    return _scan_calls(text, first)


def _first_call(text: str, final: bool) -> int | None:
    """Where the first call's "{" would be; None while the text could still become
    the tag or reach a "{"."""
    i = skip_ws(text, 0)
    if text.startswith(PYTHON_TAG, i):
        i = skip_ws(text, i + len(PYTHON_TAG))
    elif PYTHON_TAG.startswith(text[i:]) and not final:
        return None
    if i == len(text) and not final:
        return None
    return i


def _scan_calls(text: str, first: int) -> list[Piece]:
    pieces: list[Piece] = []
    raw_start, i = 0, first  # the first call's text takes the tag and whitespace with it
    while True:
        found = scan_call_object(text, i, ARGUMENT_KEYS)
        pieces.append(CallPiece.of(found, text[raw_start:]))
        if found.state is not State.COMPLETE:
            return pieces
        i = skip_ws(text, found.end)
        if text.startswith(";", i):
            i = skip_ws(text, i + 1)
        if i == len(text):
            return pieces  # the end of the reply, or more calls to come
        if text[i] != "{":
            pieces.append(TextPiece(text[found.end:]))
            return pieces
        raw_start = i


class Parser(ScanningParser):
    name = NAME
    start_markers = START_MARKERS
    markers = (PYTHON_TAG,)
    opening = rf"\A\s*(?:{re.escape(PYTHON_TAG)}|\{{)"   # a reply that starts with a call
    scan = staticmethod(scan)
