"""Scanning JSON that may still be arriving.

`scan_value` answers where a JSON value ends, raises `Incomplete` when the text ends
before the value does (more text could still finish it), or `Malformed(pos)` at the
first character no continuation can repair: `text[:pos]` is always a viable prefix.
That exactness is what makes streaming safe: argument text up to the end of a viable
prefix can be sent and will never have to be taken back.

`scan_call_object` reads one `{"name": ..., "arguments": {...}}` object on top of it.
Strict JSON as `json.loads` reads it (no raw control characters in strings).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum

_WS = re.compile(r"[ \t\n\r]*")
_HEX = re.compile(r"[0-9a-fA-F]{0,4}")
_NUMBER_RUN = re.compile(r"[-+0-9.eE]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.(?:[0-9]+(?:[eE][+-]?[0-9]*)?)?|[eE][+-]?[0-9]*)?)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_SIMPLE_ESCAPES = '"\\/bfnrt'
_STRING_BODY = re.compile(r'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*')


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


# Below this many open containers, complete ones are left to json's C scanner; each
# open one costs it a read to the end of the text, so it is not asked at every depth.
_FAST_DEPTH = 16
# json's C scanner, minus NaN and Infinity (not JSON).
_SCAN_ONCE = json.JSONDecoder(parse_constant=_reject_constant).scan_once


class Incomplete(Exception):
    """The text ends before the value does."""


class Malformed(Exception):
    """`pos` is the first character that no continuation can make valid."""

    def __init__(self, pos: int) -> None:
        super().__init__(pos)
        self.pos = pos


class State(Enum):
    OPEN = "open"            # the text ends inside it
    COMPLETE = "complete"
    BROKEN = "broken"        # malformed: it can never become a call


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def scan_value(text: str, pos: int) -> int:
    """The index just past the JSON value starting at `pos`. Character by character,
    with a stack instead of recursion so that any depth reads as json's scanner reads
    it, except that complete containers are left to that scanner (fast, in C)."""
    closers: list[str] = []
    i = pos
    while True:
        i, opened = _enter_value(text, i, closers)
        if not opened:
            i = _close_containers(text, i, closers)
            if not closers:
                return i


def _complete_container_end(text: str, pos: int) -> int | None:
    """Where a complete object or array ends, read by json's C scanner; None if it
    is not one (incomplete, malformed, too deep for it): then we scan it ourselves.
    Re-reading the whole reply every step stays cheap this way."""
    if not text.startswith(("{", "["), pos):
        return None
    try:
        return _SCAN_ONCE(text, pos)[1]
    except (ValueError, StopIteration, RecursionError):
        return None


def _enter_value(text: str, i: int, closers: list[str]) -> tuple[int, bool]:
    """The value at `i`: (its end, False), or, when it opens a container with
    members, (where the first member's value starts, True)."""
    end = _complete_container_end(text, i) if len(closers) < _FAST_DEPTH else None
    if end is not None:
        return end, False
    expect(text, i, "")
    if text[i] not in "{[":
        return _scan_scalar(text, i), False
    closers.append("}" if text[i] == "{" else "]")
    inside = skip_ws(text, i + 1)
    expect(text, inside, "")
    if text[inside] == closers[-1]:
        closers.pop()
        return inside + 1, False
    return _member_start(text, inside, closers[-1]), True


def _close_containers(text: str, i: int, closers: list[str]) -> int:
    """After a value ending at `i`: close containers until one goes on with another
    member (return where its value starts) or none is left (return the end)."""
    while closers:
        i = skip_ws(text, i)
        expect(text, i, "," + closers[-1])
        if text[i] == ",":
            return _member_start(text, skip_ws(text, i + 1), closers[-1])
        closers.pop()
        i += 1
    return i


def _member_start(text: str, i: int, closer: str) -> int:
    """Where the next member's value starts: past its key in an object."""
    return _scan_key(text, i)[1] if closer == "}" else i


def _scan_scalar(text: str, pos: int) -> int:
    first = text[pos]
    if first == '"':
        return scan_string(text, pos)
    if first == "-" or first in "0123456789":
        return _scan_number(text, pos)
    return _scan_literal(text, pos)


def scan_string(text: str, pos: int) -> int:
    i = pos + 1
    while True:
        i = _STRING_BODY.match(text, i).end()
        if i >= len(text):
            raise Incomplete
        if text[i] == '"':
            return i + 1
        if text[i] != "\\":
            raise Malformed(i)  # a raw control character
        i = _scan_escape(text, i)  # cut off or bad, or the body would have taken it


def _scan_escape(text: str, i: int) -> int:
    if i + 1 >= len(text):
        raise Incomplete
    kind = text[i + 1]
    if kind in _SIMPLE_ESCAPES:
        return i + 2
    if kind != "u":
        raise Malformed(i + 1)
    end = _HEX.match(text, i + 2).end()
    if end == i + 6:
        return end
    if end == len(text):
        raise Incomplete
    raise Malformed(end)


def _scan_number(text: str, pos: int) -> int:
    end = _NUMBER_RUN.match(text, pos).end()
    run = text[pos:end]
    viable = _NUMBER_PREFIX.match(run).end()
    if viable < len(run):
        raise Malformed(pos + viable)
    if end == len(text):
        raise Incomplete  # even "12" could still become "123"
    if not _NUMBER.fullmatch(run):
        raise Malformed(end)  # "1." or "-" followed by something else
    return end


def _scan_literal(text: str, pos: int) -> int:
    literal = _LITERALS.get(text[pos])
    if literal is None:
        raise Malformed(pos)
    for k, expected in enumerate(literal):
        if pos + k >= len(text):
            raise Incomplete
        if text[pos + k] != expected:
            raise Malformed(pos + k)
    return pos + len(literal)


def _scan_key(text: str, i: int) -> tuple[int, int]:
    """A member's key at `i`: where the key string ends and where its value starts."""
    expect(text, i, '"')
    key_end = scan_string(text, i)
    colon = skip_ws(text, key_end)
    expect(text, colon, ":")
    return key_end, skip_ws(text, colon + 1)


def expect(text: str, i: int, allowed: str) -> None:
    """Raise unless the text goes on at `i` with one of `allowed` (any character if empty)."""
    if i >= len(text):
        raise Incomplete
    if allowed and text[i] not in allowed:
        raise Malformed(i)


def scan_object_prefix(text: str, pos: int) -> tuple[State, int, str]:
    """A JSON object at `pos`: its state, where it ends (just past it when COMPLETE,
    the first bad character when BROKEN, the end of the text when OPEN) and its text
    up to there, which only ever grows as more text arrives."""
    try:
        expect(text, pos, "{")
        end = scan_value(text, pos)
    except Incomplete:
        return State.OPEN, len(text), text[pos:]
    except Malformed as bad:
        return State.BROKEN, bad.pos, text[pos:bad.pos]
    return State.COMPLETE, end, text[pos:end]


@dataclass
class CallObject:
    """What one `{"name": ..., "arguments": {...}}` object has shown so far."""

    state: State
    end: int                    # as in scan_object_prefix
    name: str | None = None     # once its string is complete
    call_id: str | None = None  # an "id" the model wrote, once complete
    arguments: str = ""         # raw text of the arguments object so far; "{}" when a complete call has none
    has_arguments: bool = False


def scan_call_object(text: str, pos: int, argument_keys: tuple[str, ...]) -> CallObject:
    """Read the call object at `pos` (which holds "{"). Other keys are checked as JSON
    and ignored; a missing name or a name or arguments of the wrong type breaks it."""
    found = CallObject(State.OPEN, len(text))
    try:
        end = _scan_call_members(text, pos, argument_keys, found)
    except Incomplete:
        return found
    except Malformed as bad:
        found.state, found.end = State.BROKEN, bad.pos
        return found
    if found.name is None:
        found.state, found.end = State.BROKEN, end - 1
        return found
    found.state, found.end = State.COMPLETE, end
    if not found.has_arguments:
        found.arguments = "{}"
    return found


def _scan_call_members(text: str, pos: int, argument_keys: tuple[str, ...], found: CallObject) -> int:
    i = skip_ws(text, pos + 1)
    expect(text, i, '"}')
    while text[i] != "}":
        key_end, value_start = _scan_key(text, i)
        key = json.loads(text[i:key_end])
        i = skip_ws(text, _scan_call_value(text, value_start, key, argument_keys, found))
        expect(text, i, ",}")
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            expect(text, i, '"')
    return i + 1


def _scan_call_value(text: str, i: int, key: str, argument_keys: tuple[str, ...], found: CallObject) -> int:
    """Scan one member's value, noting the name, id and arguments (the first of each)."""
    if key == "name" and found.name is None:
        expect(text, i, '"')
        end = scan_string(text, i)
        name = json.loads(text[i:end])
        if not name:
            raise Malformed(end - 1)
        found.name = name
        return end
    if key == "id" and found.call_id is None and text.startswith('"', i):
        end = scan_string(text, i)
        found.call_id = json.loads(text[i:end]) or None
        return end
    if key in argument_keys and not found.has_arguments and text.startswith('"', i):
        # The arguments object written as a JSON string (vLLM's parsers take it too): its
        # text is the string's content, once the string is whole (not before: a stream's
        # arguments only ever grow). A string that holds no object breaks the call.
        end = scan_string(text, i)
        inner = json.loads(text[i:end])
        try:
            parsed = json.loads(inner)
        except ValueError:
            raise Malformed(end - 1) from None
        if not isinstance(parsed, dict):
            raise Malformed(end - 1)
        found.has_arguments, found.arguments = True, inner
        return end
    if key in argument_keys and not found.has_arguments:
        found.has_arguments = True
        state, end, found.arguments = scan_object_prefix(text, i)
        if state is State.OPEN:
            raise Incomplete
        if state is State.BROKEN:
            raise Malformed(end)
        return end
    return scan_value(text, i)
