"""The app factory and the runner helpers shared by `ruvllm serve` and the tests."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from aiohttp import web

from ruvllm_cli.engine.loop import EngineLoop
from ruvllm_cli.server.engine_client import EngineClient
from ruvllm_cli.server.middlewares import add_cors_headers, auth_middleware, cors_middleware, error_middleware
from ruvllm_cli.server.routes import add_routes
from ruvllm_cli.server.runner import ApiAppRunner
from ruvllm_cli.server.models import ModelPool, ModelSpec, PoolSettings
from ruvllm_cli.server.state import STATE_KEY, ServerConfig, ServerState, get_state
from ruvllm_cli.server.web import add_web_routes

DEFAULT_SHUTDOWN_TIMEOUT = 10.0
# Once the shutdown timeout has ended every generation, what their handlers get to
# write those endings, and then what aiohttp gives any other handler before cancelling
# it: each only event-loop work of a few milliseconds.
FINAL_GRACE = 0.2
# A connection must deliver a request's headers within this many seconds of connecting
# or of its last answer, else it is closed, and then its body within as many again
# (else a 408, body.read_json): a client trickling either (slowloris) holds a socket
# for at most this long each. Above the 5 s after which httpx (and so the
# OpenAI SDK) drops idle pooled connections, so the client closes first and never
# reuses a connection the server is closing.
DEFAULT_IDLE_TIMEOUT = 15.0
# How long a stopping app waits for each engine it loaded to finish its step; the
# threads are daemons, and the replies have all been sent by then.
ENGINE_STOP_TIMEOUT = 0.3


def create_app(engine_loop: EngineLoop | EngineClient | None, config: ServerConfig = ServerConfig(), *,
               served_names: Sequence[str] = ()) -> web.Application:
    """An OpenAI-compatible app around `engine_loop`, set up by `config`.

    With `engine_loop=None` the engine slot starts empty (/health answers 503, the
    API 503 "loading") until `attach_engine` fills it. The app never owns the engine
    loop: whoever made it shuts it down, after the app's runner is cleaned up."""
    middlewares = [error_middleware]
    if config.cors_origins:
        middlewares.append(cors_middleware(config.cors_origins))
    if config.api_key:
        middlewares.append(auth_middleware(config.api_key))
    # aiohttp rejects a larger body itself (413); the middleware turns that into our shape.
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_size)
    state = ServerState(config)
    app[STATE_KEY] = state
    add_routes(app)
    if config.web_ui:
        add_web_routes(app)
    if config.cors_origins:
        app.on_response_prepare.append(add_cors_headers)
    app.on_shutdown.append(_start_draining)
    app.on_cleanup.append(_stop_executor)
    if engine_loop is not None:
        attach_engine(app, engine_loop, served_names)
    return app


def attach_engine(app: web.Application, engine_loop: EngineLoop | EngineClient,
                  served_names: Sequence[str], path: Path | None = None) -> None:
    """Fill the engine slot of a running app; the first name is the one /health reports.
    `path`: the model's directory or GGUF file (its size and digest on /api/tags)."""
    get_state(app).attach(engine_loop, served_names, path)


def attach_models(app: web.Application, models: Sequence[ModelSpec], settings: PoolSettings,
                  max_num_seqs: int) -> ModelPool:
    """Serve several models, each loaded on the first request that names it, instead of
    one engine (docs/design.md, section 17). The app stops the engines it loads when
    its runner is cleaned up."""
    state = get_state(app)
    state.add_models(models, settings, max_num_seqs)
    return state.models


async def _start_draining(app: web.Application) -> None:
    # RunningServer.stop sets it first; this covers a runner cleaned up directly.
    # Requests still arriving on kept-alive connections get a 503 from now on.
    get_state(app).draining = True


async def _stop_executor(app: web.Application) -> None:
    state = get_state(app)
    state.models.close(ENGINE_STOP_TIMEOUT)
    state.executor.shutdown(wait=False, cancel_futures=True)


@dataclass
class RunningServer:
    runner: web.AppRunner
    host: str
    port: int
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def stop(self) -> None:
        """Stop accepting; let in-flight requests finish within the shutdown timeout;
        then end each one left with a clean answer (a 503, or on a stream an error
        event and [DONE]) and close. Takes at most the timeout plus 3 x FINAL_GRACE."""
        state = get_state(self.runner.app)
        state.draining = True
        for site in list(self.runner.sites):
            await site.stop()
        if not await _until_idle(state, self.shutdown_timeout, interrupt=state.expired):   # end_now interrupts
            state.expired.set()
            await _until_idle(state, FINAL_GRACE)
        await self.runner.cleanup()   # with FINAL_GRACE for whatever is left (a slow /metrics)

    def end_now(self) -> None:
        """Cut a stop() short: end every request still in flight as its timeout would."""
        get_state(self.runner.app).expired.set()

    @property
    def ending(self) -> bool:
        return get_state(self.runner.app).expired.is_set()


async def _until_idle(state: ServerState, timeout: float, interrupt: asyncio.Event | None = None) -> bool:
    """Whether every admitted request has ended within `timeout` seconds (or before
    `interrupt` was set)."""
    waits = {asyncio.ensure_future(state.admission.idle.wait())}
    if interrupt is not None:
        waits.add(asyncio.ensure_future(interrupt.wait()))
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return state.admission.idle.is_set()


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0, *,
                       shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
                       access_log: bool = False) -> RunningServer:
    """Listen on host:port (0 picks a free port) and return at once."""
    runner = ApiAppRunner(
        # RunningServer.stop waits `shutdown_timeout` for requests itself; aiohttp's own
        # wait (twice its timeout, then a cut connection) is only for stragglers.
        app, shutdown_timeout=FINAL_GRACE, keepalive_timeout=idle_timeout,
        # A client that disconnects cancels its handler, which cancels its engine requests.
        handler_cancellation=True,
        access_log=logging.getLogger("aiohttp.access") if access_log else None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = [address for address in runner.addresses if isinstance(address, tuple)]
    return RunningServer(runner, host, bound[0][1] if bound else port, shutdown_timeout)

