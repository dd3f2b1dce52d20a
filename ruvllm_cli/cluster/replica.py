"""One Ray Serve replica: one engine, built by the same setup code as `ruvllm serve`.

`deploy.py` wraps `EngineReplica` in `serve.deployment`; the front door calls
`generate` through a DeploymentHandle (streamed), and `facts` once at start. The
replica's first item of every stream is its `ReplicaHello`: the front door learns
which replica holds the request before any token, so a request whose replica dies
before that can be sent again with nothing lost (client.ReplicaStream)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ruvllm_cli.cluster.spec import ReplicaSpec
from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import FinishReason, RequestOptions
from ruvllm_cli.engine.sampling import SamplingParams


@dataclass(frozen=True)
class ReplicaJob:
    """One engine request as it travels to a replica; the router reads `prompt_ids`."""

    prompt_ids: list[int]
    params: SamplingParams
    options: RequestOptions


@dataclass(frozen=True)
class ReplicaHello:
    """Which replica took a request (the first item of its stream)."""

    replica_id: str
    pid: int


class EngineReplica:
    """Loads the model with `spec`'s options and runs one EngineLoop."""

    def __init__(self, spec: ReplicaSpec) -> None:
        import torch

        from ruvllm_cli.cli.context import AppContext
        from ruvllm_cli.cli.engine_setup import open_engine
        from ruvllm_cli.engine.loop import EngineLoop

        # Ray sets OMP_NUM_THREADS to the actor's num_cpus; torch's pool follows the flag.
        torch.set_num_threads(spec.threads)
        app = AppContext(verbose=spec.verbose, no_color=True, cache_dir_option=spec.cache_dir)
        adapters = [(name, path) for name, path in spec.adapters]
        self.opened = open_engine(app, spec.model, adapters=adapters, **spec.engine_options)
        # A pool too small to serve a request is refused as in one process (a replica
        # had served "context 128 tokens"); deploy reports the error (replica_error).
        self.opened.check_served_context()
        self.loop = EngineLoop(self.opened.engine)
        self.hello = ReplicaHello(replica_id(), os.getpid())

    def facts(self) -> Any:
        from ruvllm_cli.cluster.model_view import ModelFacts

        return ModelFacts.of(self.opened)

    async def generate(self, job: ReplicaJob) -> AsyncIterator[ReplicaHello | RequestOutput]:
        """The hello, then the request's outputs; a cancelled call aborts the request."""
        yield self.hello
        try:
            stream = self.loop.submit(job.prompt_ids, job.params, job.options, loop=asyncio.get_running_loop())
        except Exception as error:  # noqa: BLE001 - the front door checked the prompt; the engine may have died
            yield RequestOutput("", [], "", finished=True, finish_reason=FinishReason.ERROR, error=str(error))
            return
        try:
            async for output in stream:
                yield output
        finally:
            stream.cancel()

    async def snapshot(self) -> Any:
        """The engine's figures for the front door's /metrics."""
        from ruvllm_cli.server.metrics import read_engine_snapshot

        return await asyncio.to_thread(self.loop.call, read_engine_snapshot)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve calls it on the replica actor; the front door too, for /metrics."""
        return {"snapshot": await self.snapshot()}

    def check_health(self) -> None:
        """Ray Serve restarts a replica whose engine thread died."""
        if not self.loop.healthy:
            raise RuntimeError("the engine thread of this replica has stopped")


def replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id
