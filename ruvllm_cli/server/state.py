"""What one server holds: its settings, its models, admission and metrics."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncContextManager, Iterator, Sequence

from aiohttp import web

from ruvllm_cli.engine.loop import EngineLoop
from ruvllm_cli.server.engine_client import EngineClient, as_client
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.metrics import ServerMetrics
from ruvllm_cli.server.model_metrics import PoolCollector
from ruvllm_cli.server.models import Lease, ModelPool, ModelSpec, PoolSettings
from ruvllm_cli.server.protocol import RequestLimits

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_SIZE = 4 * 1024 * 1024
# A chat reply without max_tokens: the whole context left could take minutes on a CPU.
DEFAULT_CHAT_MAX_TOKENS = 1024


@dataclass(frozen=True)
class ServerConfig:
    """What `ruvllm serve`'s options set for one app (an empty `api_key`: none)."""

    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_queue: int = DEFAULT_MAX_QUEUE
    max_body_size: int = DEFAULT_MAX_BODY_SIZE
    limits: RequestLimits = RequestLimits()
    chat_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS   # a chat request's max_tokens when it sets none
    verbose: bool = False
    tool_call_parser: str | None = None   # None: detected from the model's chat template
    reasoning_parser: str = "auto"        # auto: from the chat template; none: reasoning stays in the content
    model_sampling: bool = True           # a request's unset knobs take the model's generation_config values
    allow_runtime_lora: bool = False      # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    cache_dir: Path | None = None         # where a hub id given as lora_path is fetched to
    web_ui: bool = True                   # the chat page at / (server/web.py)


class Admission:
    """Bounds the sequences admitted: `capacity` = decoded together + allowed to wait.
    A shutdown waits until `idle`: no generation and no /metrics scrape in flight."""

    def __init__(self) -> None:
        self.capacity = 0
        self.in_flight = 0    # sequences
        self.requests = 0     # the requests those sequences belong to
        self.scrapes = 0      # /metrics requests, which wait on the engine thread too
        self.idle = asyncio.Event()   # set while no request is admitted
        self.idle.set()

    @contextmanager
    def scraping(self) -> Iterator[None]:
        """Count a /metrics request while the body runs (it holds no sequence)."""
        self.scrapes += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.scrapes -= 1
            self._settle()

    def _settle(self) -> None:
        if not self.requests and not self.scrapes:
            self.idle.set()

    @contextmanager
    def reserve(self, n: int, param: str = "n") -> Iterator[None]:
        """Hold `n` sequences while the body runs: a 400 naming `param` when they could
        never fit, a 429 with Retry-After when they do not fit now."""
        # Even an idle server refuses more than its capacity: letting one request in
        # whatever its size would lock every other client out until it is done.
        if n > self.capacity:
            raise ApiError(400, f"This request asks for {n} sequences; this server holds at most "
                                f"{self.capacity}.", param=param, code="invalid_value")
        if self.in_flight + n > self.capacity:
            raise ApiError(429, f"The server is busy ({self.in_flight} sequences in flight, at most "
                                f"{self.capacity}); retry shortly.", code="queue_full",
                           headers={"Retry-After": "1"})
        self.in_flight += n
        self.requests += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.in_flight -= n
            self.requests -= 1
            self._settle()


class ServerState:
    """Shared by the handlers of one app; only touched from its event loop."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.admission = Admission()
        self.metrics = ServerMetrics(lambda: self.admission.requests, lambda: self.admission.in_flight)
        # Submitting and tokenizing happen here, off the event loop (see bridge.submit).
        self.executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ruvllm-submit")
        # The models served: one attached engine, or several loaded on demand (server/models.py).
        self.models = ModelPool(config.tool_call_parser, self.executor, config.reasoning_parser,
                                config.model_sampling)
        self.metrics.registry.register(PoolCollector(self.models))
        self.limits = config.limits
        self.started = time.monotonic()
        self.wall_started = time.time()
        self.ready_at: float | None = None
        self._draining = False
        # Set when the shutdown timeout runs out: every generation still going ends at once.
        self.expired = asyncio.Event()

    def attach(self, engine_loop: EngineLoop | EngineClient, served_names: Sequence[str],
               path: Path | None = None) -> None:
        """Fill the engine slot: from now on /health is 200 and the API answers."""
        engine_loop = as_client(engine_loop)
        names = tuple(dict.fromkeys(n for n in served_names if n))
        if not names:
            raise ValueError("a server needs at least one served model name")
        self.models.attach(names, engine_loop, path)
        self._open(engine_loop.engine.config.max_num_seqs)

    def add_models(self, specs: Sequence[ModelSpec], settings: PoolSettings, max_num_seqs: int) -> None:
        """Serve models loaded on first use (each engine with `max_num_seqs`): the API answers at once."""
        self.models.settings = settings
        for spec in specs:
            self.models.add(spec)
        self._open(max_num_seqs)

    def _open(self, max_num_seqs: int) -> None:
        self.admission.capacity = max_num_seqs + self.config.max_queue
        self.limits = self.config.limits.within(self.admission.capacity)
        self.ready_at = time.monotonic()

    @property
    def draining(self) -> bool:
        """The server is stopping: new requests get a 503, and so do those waiting for a model."""
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        if value:
            self.models.drain()

    @property
    def model_name(self) -> str:
        """The first model's name, which /health reports."""
        return self.models.entries[0].name if self.models.entries else ""

    def require_ready(self) -> None:
        if self.draining:
            raise ApiError(503, "The server is shutting down.", code="shutting_down")
        if self.ready_at is None:
            raise ApiError(503, "The model is still loading; retry shortly.", code="model_loading",
                           headers={"Retry-After": "5"})

    def model_for(self, name: str) -> AsyncContextManager[Lease]:
        """The model a request's `model` names (a base model, or a LoRA adapter on one),
        loaded if need be and held while the `async with` block runs: a 404 for an
        unknown name, a 503 while the server starts or stops or when it cannot load."""
        self.require_ready()
        return self.models.lease(name)


STATE_KEY = web.AppKey("ruvllm_state", ServerState)


def get_state(app: web.Application) -> ServerState:
    return app[STATE_KEY]
