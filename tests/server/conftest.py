"""Server fixtures: the real app on 127.0.0.1 (ephemeral port), served by its own event
loop in a background thread, around an engine on the session's tiny float32 model.

`server` is one shared server (names "tiny" and "org/tiny-model"); after each test
that uses it the engine must be idle with every KV block free. `make_server(...)`
builds a dedicated one (its own engine, app options) and stops it after the test.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.loader import LoadedModel, load_model
from ruvllm_cli.engine.loop import EngineLoop
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.server import RunningServer, ServerConfig, create_app, start_server
from ruvllm_cli.server.app import DEFAULT_IDLE_TIMEOUT
from ruvllm_cli.server.state import ServerState, get_state

NAMES = ("tiny", "org/tiny-model")


class ServerThread:
    """Runs `app` with start_server (as `ruvllm serve` does) on a private event loop."""

    def __init__(self, app: web.Application, shutdown_timeout: float = 5.0,
                 idle_timeout: float = DEFAULT_IDLE_TIMEOUT) -> None:
        self.app = app
        self.shutdown_timeout = shutdown_timeout
        self.idle_timeout = idle_timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running: RunningServer | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="test-server", daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self.running = await start_server(self.app, "127.0.0.1", 0, shutdown_timeout=self.shutdown_timeout,
                                              idle_timeout=self.idle_timeout)
        except BaseException as error:  # noqa: BLE001 - reported by start()
            self._error = error
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        await self.running.stop()

    def start(self) -> "ServerThread":
        self._thread.start()
        assert self._ready.wait(15), "the server did not start"
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn: Callable[[], Any], timeout: float = 10) -> Any:
        """Run `fn()` on the server's event loop (where app state lives)."""
        assert self.loop is not None

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self, timeout: float = 30) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the server did not stop"

    @property
    def url(self) -> str:
        assert self.running is not None
        return self.running.url


@dataclass
class LiveServer:
    thread: ServerThread
    engine_loop: EngineLoop | None
    names: tuple[str, ...] = NAMES
    api_key: str | None = None
    _stopped: bool = field(default=False, repr=False)

    @property
    def url(self) -> str:
        return self.thread.url

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def model(self) -> str:
        return self.names[0]

    @property
    def state(self) -> ServerState:
        return get_state(self.thread.app)

    def engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        assert self.engine_loop is not None
        return self.engine_loop.call(fn)

    def wait_idle(self, timeout: float = 15) -> None:
        """Until no sequence is admitted and the engine has nothing left to run."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.admission.in_flight == 0 and not self.engine(lambda e: e.has_unfinished):
                return
            time.sleep(0.02)
        raise AssertionError("the server did not become idle")

    def assert_clean(self) -> None:
        """Idle, block accounting intact, and every KV block back in the free pool."""
        self.wait_idle()
        self.engine(lambda e: e.check_integrity())
        free, total = self.engine(lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks))
        assert free == total

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self.thread.stop()
            if self.engine_loop is not None:
                self.engine_loop.shutdown()


@pytest.fixture(scope="session")
def server_model(tiny_model_dir) -> LoadedModel:
    return load_model(tiny_model_dir, "cpu", Quantization.F32)


def build_server(model: LoadedModel, *, names: tuple[str, ...] = NAMES, engine: dict[str, Any] | None = None,
                 shutdown_timeout: float = 5.0, idle_timeout: float = DEFAULT_IDLE_TIMEOUT, attach: bool = True,
                 adapters: dict[str, Any] | None = None, **app_options: Any) -> LiveServer:
    config = {"max_num_seqs": 16, "max_model_len": 1024, **(engine or {})}
    llm = LLMEngine(model, EngineConfig(device="cpu", quantization=Quantization.F32, **config))
    for name, path in (adapters or {}).items():
        llm.add_lora(name, path)
    engine_loop = EngineLoop(llm)
    app = create_app(engine_loop if attach else None, ServerConfig(**app_options), served_names=names)
    live = LiveServer(ServerThread(app, shutdown_timeout, idle_timeout), engine_loop, names,
                      app_options.get("api_key"))
    try:
        live.thread.start()
    except BaseException:
        engine_loop.shutdown()
        raise
    return live


@pytest.fixture(scope="session")
def _shared_server(server_model: LoadedModel) -> Iterator[LiveServer]:
    live = build_server(server_model)
    yield live
    live.stop()


@pytest.fixture
def server(_shared_server: LiveServer) -> Iterator[LiveServer]:
    yield _shared_server
    _shared_server.assert_clean()


@pytest.fixture
def make_server(server_model: LoadedModel) -> Iterator[Callable[..., LiveServer]]:
    """`make_server(engine={...EngineConfig fields}, api_key=..., max_queue=..., ...)`: the
    keywords beyond `engine`, `names`, `shutdown_timeout`, `idle_timeout` and `attach` are
    ServerConfig's."""
    made: list[LiveServer] = []

    def make(**options: Any) -> LiveServer:
        live = build_server(server_model, **options)
        made.append(live)
        return live

    yield make
    for live in made:
        live.stop()


@pytest.fixture
def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_adapter_server(model: LoadedModel, adapters: dict[str, Any], *, engine: dict[str, Any] | None = None,
                         **app_options: Any) -> LiveServer:
    """A server whose engine serves LoRA `adapters` ({name: directory}). Give it a
    LoadedModel of its own: adapters wrap the model's layers, and other tests'
    servers must not see them."""
    return build_server(model, engine={"max_num_seqs": 4, "max_model_len": 512, **(engine or {})},
                        adapters=adapters, **app_options)
