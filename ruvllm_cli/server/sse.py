"""Server-sent events the way OpenAI streams: `data: {json}` per chunk, `data: [DONE]` last."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",   # keep reverse proxies from holding chunks back
}


class EventStream:
    """One streamed response. Writes raise ConnectionResetError once the client is gone."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(status=200, headers=SSE_HEADERS)

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, data: Any) -> None:
        await self.response.write(encode_event(data))

    async def close(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


def encode_event(data: Any) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
