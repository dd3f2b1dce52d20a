"""Mistral tool calls, both spellings after the `[TOOL_CALLS]` marker:
v3 `[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "abc123xyz"}, ...]`, and the
newer `[TOOL_CALLS]f[ARGS]{...}` (optionally `f[CALL_ID]abc123xyz[ARGS]{...}`), one
marker per call. Text before and after is content.

Mistral's templates require call ids of exactly 9 alphanumerics; an id the model
wrote is kept. Nothing is read after a call that is not one: from its start on, the
rest of the reply is content (or, in a stream that already announced it, is dropped).
"""

from __future__ import annotations

import re

from ruvllm_cli.engine.tool_parsers.base import CallPiece, Piece, ScanningParser, TextPiece, text_until_marker
from ruvllm_cli.engine.tool_parsers.json_scan import State, scan_call_object, scan_object_prefix, skip_ws

NAME = "mistral"
START = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
START_MARKERS = (START,)
ARGUMENT_KEYS = ("arguments",)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_ID = re.compile(r"[A-Za-z0-9]*")


def scan(text: str, final: bool) -> list[Piece]:
    pieces: list[Piece] = []
    pos: int | None = 0
    while pos is not None:
        start = text.find(START, pos)
        if start < 0:
            pieces.append(text_until_marker(text, pos, START_MARKERS, final))
            break
        pieces.append(TextPiece(text[pos:start]))
        body = skip_ws(text, start + len(START))
        if body == len(text):
            pieces.append(CallPiece(State.OPEN, text[start:]))
            break
        scan_body = _scan_list if text[body] == "[" else _scan_named
        pos = scan_body(text, start, body, final, pieces)
    return pieces


def _scan_list(text: str, start: int, body: int, final: bool, pieces: list[Piece]) -> int | None:
    """v3: a JSON list of call objects. Returns where the text after it starts (None
    while it may still go on; a list left open at the end of the reply still counts)."""
    i = skip_ws(text, body + 1)
    if text.startswith("]", i):
        return i + 1
    raw_start = start  # the first call's text takes the marker with it
    while True:
        if not text.startswith("{", i):
            pieces.append(CallPiece(State.OPEN if i == len(text) else State.BROKEN, text[raw_start:]))
            return None
        found = scan_call_object(text, i, ARGUMENT_KEYS)
        pieces.append(CallPiece.of(found, text[raw_start:]))
        i = skip_ws(text, found.end)
        if found.state is not State.COMPLETE or i == len(text):
            return None
        if text[i] not in ",]":
            return found.end  # no "]": what follows is text again
        if text[i] == "]":
            return i + 1
        raw_start = i = skip_ws(text, i + 1)


def _scan_named(text: str, start: int, body: int, final: bool, pieces: list[Piece]) -> int | None:
    """`name[ARGS]{...}` or `name[CALL_ID]id[ARGS]{...}`."""
    name_end = _FUNCTION_NAME.match(text, body).end()
    call_id, args_at = _after_name(text, name_end)
    if args_at is None or name_end == body:
        waiting = not final and _could_be_header(text, name_end)
        pieces.append(CallPiece(State.OPEN if waiting else State.BROKEN, text[start:]))
        return None
    state, end, arguments = scan_object_prefix(text, skip_ws(text, args_at))
    complete = state is State.COMPLETE
    raw = text[start:end] if complete else text[start:]
    pieces.append(CallPiece(state, raw, text[body:name_end], call_id, arguments))
    return end if complete else None


def _after_name(text: str, name_end: int) -> tuple[str | None, int | None]:
    """The call id written between name and arguments, and where the arguments start."""
    if text.startswith(ARGS, name_end):
        return None, name_end + len(ARGS)
    if not text.startswith(CALL_ID, name_end):
        return None, None
    id_end = _ID.match(text, name_end + len(CALL_ID)).end()
    if not text.startswith(ARGS, id_end):
        return None, None
    return text[name_end + len(CALL_ID):id_end] or None, id_end + len(ARGS)


def _could_be_header(text: str, name_end: int) -> bool:
    """Whether the text after a name could still grow into `[ARGS]` or `[CALL_ID]id[ARGS]`."""
    rest = text[name_end:]
    if ARGS.startswith(rest) or CALL_ID.startswith(rest):
        return True
    if not rest.startswith(CALL_ID):
        return False
    id_end = _ID.match(text, name_end + len(CALL_ID)).end()
    return ARGS.startswith(text[id_end:])


class Parser(ScanningParser):
    name = NAME
    start_markers = START_MARKERS
    markers = (START, ARGS, CALL_ID)
    opening = re.escape(START)
    id_length = 9
    id_prefix = ""
    scan = staticmethod(scan)
