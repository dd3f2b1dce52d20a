"""`Expect: 100-continue` answered only for a body the server will read: a client that
asks before uploading (curl does for large bodies) is told at once that its body is
too large or its API key is missing, instead of being invited to send megabytes that
get a 413 or a 401 afterwards. aiohttp runs this before the middlewares, so the
answers here are built in the route's error shape directly."""

from __future__ import annotations

from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.state import get_state


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    from ruvllm_cli.server.middlewares import error_shape, key_error

    state = get_state(request.app)
    error = None
    if request.content_length is not None and request.content_length > state.config.max_body_size:
        error = ApiError(413, f"The request body is too large: {request.content_length} bytes, the limit is "
                              f"{state.config.max_body_size} bytes.", code="request_too_large", close=True)
    elif state.config.api_key:
        error = key_error(request, state.config.api_key)
    if error is not None:
        error.close = True   # its body was never invited: none of it is read
        return error.response(error_shape(request.path))
    return await _default_expect_handler(request)
