"""The aiohttp runner we serve with. aiohttp answers what fails before a request
reaches the app (an oversized header, a malformed request line) itself, in plain
text and with a logged traceback; our connections answer those in OpenAI's shape,
and close at once after an answer marked CLOSE_AT_ONCE (a body that timed out)."""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from ruvllm_cli.server.errors import CLOSE_AT_ONCE, ApiError

log = logging.getLogger("ruvllm.server")


class ApiRequestHandler(RequestHandler):
    """aiohttp's connection, but its own error answers are JSON errors in our shape."""

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:   # the client's fault, and a common one on a public port: one line, no traceback
            log.info("bad HTTP request from %s: %s", request.remote, message or exc)
        if request.writer.output_size > 0:   # as aiohttp's: too late for another answer
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        text = f"Bad HTTP request: {message}" if status < 500 and message else \
            "The server had an error while processing your request."
        response = ApiError(status, text, code="bad_http_request" if status < 500 else None).response()
        response.force_close()
        return response


    async def finish_response(self, request: BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        if not resp.get(CLOSE_AT_ONCE) and "Content-Encoding" in request.headers and not request.content.at_eof():
            # aiohttp would read the unread rest of a compressed body after the answer (a
            # 401 or 404 before the handler read it), and a corrupt one logged a traceback.
            resp[CLOSE_AT_ONCE] = True
        answered = await super().finish_response(request, resp, start_time)
        if resp.get(CLOSE_AT_ONCE):
            self.force_close()   # a client trickling its body, or one we will not decode: read none of the rest
        return answered


class _ApiServer(web.Server):
    def __call__(self) -> RequestHandler:
        return ApiRequestHandler(self, loop=self._loop, **self._kwargs)


class ApiAppRunner(web.AppRunner):
    """web.AppRunner whose connections are ApiRequestHandlers."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp offers no option for the connection class; _ApiServer differs from
        # the Server it built only in the class it makes connections of.
        server.__class__ = _ApiServer
        return server
