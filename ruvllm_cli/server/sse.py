"""Server-sent events. OpenAI streams `data: {json}` chunks and `data: [DONE]` last;
Anthropic names each event (`event: message_start`) and ends with its own last
event; Ollama's API streams one JSON object per line instead (NDJSONStream). The
response formats decide what to send (responses.py, messages_api/responses.py,
ollama_api/responses.py); this module only writes it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Union

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",   # keep reverse proxies from holding chunks back
}


@dataclass(frozen=True)
class Event:
    """One event with an `event:` line (Anthropic's), or `data` that is sent as it is
    (OpenAI's `[DONE]`)."""

    data: Any
    name: str | None = None


DONE = Event("[DONE]")
# What a format hands the stream: a chunk's JSON (sent as a `data:` line), or an Event.
Chunk = Union[dict[str, Any], Event]


class EventStream:
    """One streamed response. Writes raise ConnectionResetError once the client is gone."""

    headers = SSE_HEADERS

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers=self.headers)

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, chunk: Chunk) -> None:
        await self.response.write(encode_event(chunk))

    async def close(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response


class NDJSONStream(EventStream):
    """A stream of JSON objects, one a line (Ollama's `application/x-ndjson`)."""

    headers = {**SSE_HEADERS, "Content-Type": "application/x-ndjson"}

    async def send(self, chunk: Chunk) -> None:
        assert not isinstance(chunk, Event), "an NDJSON stream has no named events"
        await self.response.write(_json(chunk) + b"\n")


def encode_event(chunk: Chunk) -> bytes:
    if not isinstance(chunk, Event):
        return b"data: " + _json(chunk) + b"\n\n"
    data = chunk.data.encode("utf-8") if isinstance(chunk.data, str) else _json(chunk.data)
    head = f"event: {chunk.name}\n".encode("utf-8") if chunk.name else b""
    return head + b"data: " + data + b"\n\n"


# Characters that JSON carries raw but some line readers split lines at (httpx's
# iter_lines, and with it Ollama's client: a reply holding one broke the stream's line).
_LINE_BREAKS = {"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"}
_LINE_BREAK = str.maketrans(_LINE_BREAKS)


def _json(data: Any) -> bytes:
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if any(mark in text for mark in _LINE_BREAKS):
        text = text.translate(_LINE_BREAK)
    return text.encode("utf-8")
