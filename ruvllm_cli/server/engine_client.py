"""The seam between the handlers and whatever runs the engine: the in-process
EngineLoop (`LocalEngine`), or Ray Serve replicas (`ruvllm_cli.cluster.client`).

The handlers prepare a request (template, tokens, grammar checks) against
`client.engine`, which only needs what never changes after start-up (tokenizer,
context length, vocabulary, adapters' names); the work itself goes through `submit`."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Protocol, Sequence

from ruvllm_cli.engine.loop import EngineLoop
from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import RequestOptions
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.server.metrics import EngineSnapshot, read_engine_snapshot


class EngineStream(Protocol):
    """One request's outputs, ending with a `finished` one (engine.loop.RequestStream)."""

    request_id: str
    finished: bool

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...


class EngineClient(Protocol):
    """What the server calls; any thread may call `submit`, `snapshot` and `call`."""

    @property
    def engine(self) -> Any:
        """What preparing a request reads: tokenizer, max_model_len, vocab_size,
        config.max_num_seqs, grammar_compiler, lora.names(), adapter(name)."""

    @property
    def healthy(self) -> bool: ...

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, options: RequestOptions,
               loop: asyncio.AbstractEventLoop) -> EngineStream:
        """Queue a request (UsageError for a bad prompt) and return its stream at once."""

    def snapshot(self) -> EngineSnapshot:
        """The engines' figures for /metrics (blocks until read)."""

    def health(self) -> dict[str, Any]:
        """Fields /health adds to its body (the replicas' states)."""

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` where the engine lives (runtime LoRA loading)."""


class LocalEngine:
    """The EngineLoop of this process as an EngineClient."""

    def __init__(self, engine_loop: EngineLoop) -> None:
        self.engine_loop = engine_loop

    @property
    def engine(self) -> Any:
        return self.engine_loop.engine

    @property
    def healthy(self) -> bool:
        return self.engine_loop.healthy

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, options: RequestOptions,
               loop: asyncio.AbstractEventLoop) -> EngineStream:
        return self.engine_loop.submit(prompt_ids, params, options, loop=loop)

    def snapshot(self) -> EngineSnapshot:
        return self.engine_loop.call(read_engine_snapshot)

    def health(self) -> dict[str, Any]:
        return {}

    def call(self, fn: Callable[[Any], Any]) -> Any:
        return self.engine_loop.call(fn)


def as_client(engine: EngineLoop | EngineClient) -> EngineClient:
    return LocalEngine(engine) if isinstance(engine, EngineLoop) else engine
