"""One model of the pool (server/models.py): its spec, its state, what a loaded one
gives the handlers, and a request's lease on it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ruvllm_cli.engine.loop import EngineLoop
from ruvllm_cli.engine.reasoning import model_reasoning
from ruvllm_cli.server.engine_client import EngineClient, as_client
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.token_text import TokenTexts

if TYPE_CHECKING:
    from ruvllm_cli.engine.reasoning import Reasoning
    from ruvllm_cli.engine.tool_parsers import ToolParser


class ModelStatus(str, Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"


# Statuses that hold (or are about to hold, or still hold) a model's memory.
OCCUPYING = (ModelStatus.LOADING, ModelStatus.LOADED, ModelStatus.UNLOADING)
Adapters = Sequence[tuple[str, Path]]
# Builds a model's engine loop, serving these LoRA adapters; blocks (a daemon thread runs it).
Loader = Callable[[Adapters], EngineLoop]


@dataclass(frozen=True)
class ModelSpec:
    """A model the pool may load: the names requests give (the first is reported)."""

    names: tuple[str, ...]
    load: Loader
    adapters: tuple[tuple[str, Path], ...] = ()   # --lora adapters, loaded with it
    path: Path | None = None                       # its directory or GGUF file, read while it is not loaded


@dataclass(frozen=True)
class PoolSettings:
    max_loaded: int | None = None     # models loaded at once; None: no limit
    keep_alive: float | None = None   # seconds idle before unloading; None: never; 0: at once
    slot_timeout: float = 120.0       # how long a request waits for busy models to free a slot
    retry_after: float = 5.0          # a failed load is tried again by requests this much later


class ServedModel:
    """A loaded model: the EngineClient the handlers go through (this process's
    EngineLoop, or Ray Serve replicas) and what they read from its engine."""

    def __init__(self, engine: EngineLoop | EngineClient, tool_call_parser: str | None,
                 reasoning_parser: str = "auto", model_sampling: bool = True) -> None:
        self.client = as_client(engine)
        # The loop this process runs, which `shutdown` stops; a client made elsewhere
        # (the replicas) is stopped by whoever made it.
        self.engine_loop = engine if isinstance(engine, EngineLoop) else None
        self.token_texts = TokenTexts(self.client.engine.tokenizer)
        self.tool_parser = pick_tool_parser(self.client.engine, tool_call_parser)
        self.reasoning = model_reasoning(self.client.engine.tokenizer, reasoning_parser)
        # What a request's unset sampling knobs take (SamplingFields.with_defaults).
        self.sampling_defaults: dict[str, float | int] = (
            dict(self.client.engine.sampling_defaults) if model_sampling else {})
        # Its counters as it was unloaded (ModelPool._unload): what a /metrics scrape that
        # listed it just before counts, once its engine no longer answers.
        self.final_counts: Any = None

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine thread this process runs for it (if any)."""
        if self.engine_loop is not None:
            self.engine_loop.shutdown(timeout)


def pick_tool_parser(engine: Any, name: str | None) -> ToolParser | None:
    """The configured parser, else the one the model's template or architecture names."""
    from ruvllm_cli.engine.chat_call import model_tool_parser
    from ruvllm_cli.errors import UsageError

    try:
        return model_tool_parser(engine, name)
    except UsageError:
        return None


@dataclass
class ModelEntry:
    """One model of the pool and where it stands."""

    names: tuple[str, ...]
    load: Loader | None                # None: attached from outside, loaded for good
    adapters: dict[str, Path] = field(default_factory=dict)   # loaded again with the model
    status: ModelStatus = ModelStatus.UNLOADED
    served: ServedModel | None = None
    error: str | None = None           # the last load's failure, one line
    failed_at: float = 0.0
    last_used: float = 0.0
    in_flight: int = 0                 # requests holding or waiting for it
    timer: asyncio.TimerHandle | None = None   # the keep-alive unload
    timer_due: float = 0.0             # when it fires (time.time())
    unload_asked: bool = False         # a client asked for its unload (Ollama's keep_alive 0)
    counts: dict[str, int] = field(default_factory=lambda: {"loads": 0, "unloads": 0, "load_failures": 0})
    path: Path | None = None           # ModelSpec.path

    @property
    def name(self) -> str:
        return self.names[0]

    def adapter_names(self) -> list[str]:
        """Its LoRA adapters, served as models of their own (loaded or not)."""
        if self.served is not None:
            return self.served.client.engine.lora.names()
        return list(self.adapters)

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Lease:
    """A request's hold on a loaded model; empty once released, so a lease a frame
    keeps a moment longer never keeps an unloaded model's memory."""

    def __init__(self, entry: ModelEntry, served: ServedModel, adapter: str | None) -> None:
        self.entry = entry
        self.name = entry.name
        self.adapter = adapter
        self._served: ServedModel | None = served

    @property
    def served(self) -> ServedModel:
        assert self._served is not None, "the lease was released"
        return self._served

    @property
    def client(self) -> EngineClient:
        return self.served.client

    @property
    def engine(self) -> Any:
        return self.served.client.engine

    @property
    def token_texts(self) -> TokenTexts:
        return self.served.token_texts

    @property
    def reasoning(self) -> Reasoning | None:
        return self.served.reasoning

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        return self.served.sampling_defaults

    def require_tool_parser(self) -> ToolParser:
        if self.served.tool_parser is None:
            raise ApiError(400, "This model's tool-call format is not known; start the server with "
                                "--tool-call-parser (hermes, llama3_json or mistral).", param="tools",
                           code="unsupported_parameter")
        return self.served.tool_parser

    def release(self) -> None:
        self._served = None
