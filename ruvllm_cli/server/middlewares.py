"""Middlewares: errors in the route's API's shape (and request metrics), CORS, API key."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Awaitable, Callable

from aiohttp import web

from ruvllm_cli.server.errors import ApiError, ErrorShape
from ruvllm_cli.server.messages_api.errors import anthropic_error_body
from ruvllm_cli.server.ollama_api.responses import ollama_error_body
from ruvllm_cli.server.state import get_state
from ruvllm_cli.server.web import PAGE_PATHS

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger("ruvllm.server")

# The chat page and its files hold no secret: the browser gets them before it has a key.
PUBLIC_PATHS = frozenset({"/health", "/ping", *PAGE_PATHS})
# Status a client that went away gets in the metrics (nginx's convention).
CLIENT_CLOSED = 499
# Set by a handler whose client left mid-stream (its response still reads 200).
CLIENT_GONE = web.RequestKey("client_gone", bool)
# When the request reached the app (time.perf_counter), before its body was read or its
# model loaded: the start of the latency the metrics and Ollama's total_duration measure.
ARRIVED = web.RequestKey("arrived", float)
# Paths whose errors (their 401s, 404s and 413s included) take another API's shape: a
# path and everything under it (/v1/messages/count_tokens is Anthropic's too, if not
# served); every other path answers in OpenAI's.
ERROR_SHAPES: dict[str, ErrorShape] = {"/v1/messages": anthropic_error_body, "/api": ollama_error_body}


def error_shape(path: str) -> ErrorShape | None:
    return next((shape for root, shape in ERROR_SHAPES.items() if path == root or path.startswith(root + "/")),
                None)


def endpoint_label(request: web.Request) -> str:
    """The route's pattern, not the raw path, so unknown paths share one label. A path
    that exists, asked with a method it does not take (a CORS preflight's OPTIONS, a GET
    of /v1/chat/completions: 405), keeps its route's label: they had all been
    "unmatched", and a dashboard lost which route was preflighted or misused."""
    resource = request.match_info.route.resource
    if resource is None:
        resource = next((r for r in request.app.router.resources()
                         if getattr(r, "_match", lambda path: None)(request.path) is not None), None)
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON error in the route's shape (ERROR_SHAPES, else
    OpenAI's); no traceback reaches a client."""
    status = 500
    shape = error_shape(request.path)
    request[ARRIVED] = time.perf_counter()
    try:
        response = await handler(request)
        status = CLIENT_CLOSED if request.get(CLIENT_GONE) else response.status
        return response
    except ApiError as error:
        status = error.status
        return error.response(shape)
    except web.HTTPException as error:
        if error.status < 400:
            status = error.status
            raise
        status = error.status
        return http_error(request, error).response(shape)
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    except ConnectionResetError:
        # The client left (before its body had arrived, say): nobody to answer, nothing
        # to log beyond the access line. Re-raised, aiohttp logged a traceback and a 500.
        status = CLIENT_CLOSED
        return web.Response(status=CLIENT_CLOSED)
    except Exception as error:  # noqa: BLE001 - the last line of defence
        state = get_state(request.app)
        log_internal_error(request, error, state.config.verbose)
        return internal_error().response(shape)
    finally:
        get_state(request.app).metrics.requests.labels(endpoint_label(request), str(status)).inc()


def internal_error() -> ApiError:
    return ApiError(500, "The server had an error while processing your request.")


def log_internal_error(request: web.Request, error: BaseException, verbose: bool) -> None:
    """One line, its first and at most 500 characters: Ray's OutOfMemoryError carries
    a whole process table (lines of 40 MB, 124 MB of stderr in two minutes)."""
    text = str(error).strip().split("\n", 1)[0]
    if len(text) > 500:
        text = text[:500] + " ..."
    log.error("internal error on %s %s: %s: %s", request.method, request.path, type(error).__name__, text,
              exc_info=verbose)


def http_error(request: web.Request, error: web.HTTPException) -> ApiError:
    """aiohttp's own errors (routing, body size) in our shape, keeping their headers."""
    headers = {k: v for k, v in error.headers.items() if k.lower() in ("allow", "retry-after")}
    if isinstance(error, web.HTTPNotFound):
        message = f"Unknown route: {request.method} {request.path}"
        if request.path.startswith("/api/"):
            from ruvllm_cli.server.ollama_api.routes import NOT_SERVED_HINT

            message += f". {NOT_SERVED_HINT}"
    elif isinstance(error, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(error.allowed_methods))
        message = f"Method {request.method} is not allowed on {request.path} (allowed: {allowed})"
    elif isinstance(error, web.HTTPRequestEntityTooLarge):
        limit = get_state(request.app).config.max_body_size
        message = f"The request body is too large: the limit is {limit} bytes."
    else:
        message = error.text or error.reason
    code = "request_too_large" if error.status == 413 else None
    return ApiError(error.status, message, code=code, headers=headers)


def cors_middleware(origins: tuple[str, ...]) -> Callable:
    """Answers preflight requests for the allowed origins; `on_response_prepare`
    (add_cors_headers) marks the actual responses, streamed ones included."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            origin = request.headers.get("Origin", "")
            if not origin_allowed(origins, origin):
                raise ApiError(403, f"Origin {origin or '(none)'} is not allowed.")
            requested = request.headers.get("Access-Control-Request-Headers", "Authorization, Content-Type")
            return web.Response(status=204, headers={
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": requested,
                "Access-Control-Max-Age": "600"})
        return await handler(request)

    return middleware


def origin_allowed(origins: tuple[str, ...], origin: str) -> bool:
    return bool(origin) and ("*" in origins or origin in origins)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    origins = get_state(request.app).config.cors_origins
    origin = request.headers.get("Origin", "")
    if origin_allowed(origins, origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"


def auth_middleware(api_key: str) -> Callable:
    """The key on every route but PUBLIC_PATHS, as `Authorization: Bearer <key>`
    (OpenAI's clients) or `x-api-key: <key>` (Anthropic's), compared in constant time."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        error = key_error(request, api_key)
        if error is not None:
            raise error
        return await handler(request)

    return middleware


def key_error(request: web.Request, api_key: str) -> ApiError | None:
    """The 401 a request without the key gets (None: it has it, or needs none)."""
    if request.path in PUBLIC_PATHS or request.method == "OPTIONS":
        return None
    # A key read from a file or a secret often ends with a newline no client can send.
    expected = api_key.strip().encode("utf-8")
    keys = presented_keys(request)
    if not keys:
        said = request.headers.get("Authorization", "").strip()
        what = (f"The Authorization header is not 'Bearer <key>' (it starts with '{said.split()[0][:20]}')"
                if said else "Missing API key")
        return ApiError(401, f"{what}: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                        code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    # Every key is compared (no early exit), so the time tells nothing either way.
    if not sum(hmac.compare_digest(key.encode("utf-8", "surrogateescape"), expected) for key in keys):
        return ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"})
    return None


def presented_keys(request: web.Request) -> list[str]:
    """The non-empty keys a request carries: its bearer token, its x-api-key."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    keys = [token.strip()] if scheme.lower() == "bearer" else []
    keys.append(request.headers.get("x-api-key", "").strip())
    return [key for key in keys if key]
