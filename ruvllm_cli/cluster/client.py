"""The front door's EngineClient for Ray Serve replicas (server/engine_client.py).

`submit` checks the prompt here and returns a `ReplicaStream`; the stream calls the
deployment through its DeploymentHandle (streamed), so the prefix router places
it. A replica that dies before its first item (the hello) had done nothing a client
saw: the request goes again, up to RESEND_LIMIT times. After that a lost replica is
a 503 (on a stream that already started: an error event). A thread keeps the
replicas' states from Serve's controller for /health."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import Counter
from typing import Any, AsyncIterator, Callable, Sequence

import ray

from ruvllm_cli.cluster.model_view import ModelView
from ruvllm_cli.cluster.replica import ReplicaHello, ReplicaJob
from ruvllm_cli.cluster.prefix_table import routing_decisions
from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import FinishReason, RequestOptions
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.errors import UsageError
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.metrics import EngineSnapshot

RESEND_LIMIT = 2
STATUS_PERIOD_S = 1.0       # how often the replicas' states are read from Serve's controller
SNAPSHOT_TIMEOUT_S = 5.0    # a replica that does not answer /metrics within this is left out
log = logging.getLogger("ruvllm.server")


def _lost(error: BaseException) -> bool:
    """Whether `error` says the replica (its process, worker or node) went, not that the
    request failed in it: RayActorError, and Ray's OutOfMemoryError (its memory monitor
    killed the worker), WorkerCrashedError, NodeDiedError..., Serve's replica or
    deployment unavailability. Only RayActorError had been caught: a replica the memory
    monitor killed was a 500, written into a started stream."""
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    if isinstance(error, (ray.exceptions.RayTaskError, ray.exceptions.TaskCancelledError)):
        return False
    return isinstance(error, (ray.exceptions.RayError, ReplicaUnavailableError, DeploymentUnavailableError))


def replica_lost() -> ApiError:
    return ApiError(503, "The replica serving this request stopped (it is being restarted); retry the request.",
                    code="replica_unavailable", headers={"Retry-After": "1"})


class ReplicaStream:
    """One request on a replica: hello first (kept here), then RequestOutputs."""

    def __init__(self, client: "RayEngineClient", job: ReplicaJob, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self.replica: ReplicaHello | None = None
        self._client, self._job = client, job
        self._call: Any = None        # the DeploymentResponseGenerator
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None and not self.finished:
            self._call.cancel()     # Ray cancels the replica's generator, which aborts the request

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._cancelled:
            return
        try:
            await self._open()
            async for output in self._outputs():
                self.finished = output.finished
                yield output
        finally:
            if self.replica is not None:
                self._client.in_flight[self.replica.replica_id] -= 1
            if not self.finished and self._call is not None:
                self._call.cancel()

    async def _open(self) -> None:
        """Call the deployment until a replica says hello."""
        for attempt in range(RESEND_LIMIT + 1):
            self._call = self._client.call_replica(self._job)
            try:
                hello = await self._call.__anext__()
            except Exception as error:  # noqa: BLE001 - sorted by _lost
                if not _lost(error):
                    raise
                if attempt == RESEND_LIMIT:
                    raise replica_lost() from None
                log.info("%s: its replica was gone before it started; sending it again", self.request_id)
                continue
            self.replica = hello
            self._client.in_flight[hello.replica_id] += 1
            self._client.served[hello.replica_id] += 1
            return

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self._call:
                yield output
        except ray.exceptions.RayTaskError as error:   # the replica's code raised: the request failed
            yield RequestOutput(self.request_id, [], "", finished=True, finish_reason=FinishReason.ERROR,
                                error=str(error).splitlines()[0])
        except Exception as error:  # noqa: BLE001 - sorted by _lost
            if not _lost(error):
                raise
            raise replica_lost() from None


class ReplicaCounters:
    """/metrics' engine counters over replicas that come and go, never going back (a
    helper's pass: engine_steps_total 4,244 -> 1,902 when a replica was replaced, which
    Prometheus reads as a reset). A replica's last answer is kept: its counters stand
    in when it answers too late, and join the retired ones once it is gone, as the
    model pool keeps an unloaded model's (section 17)."""

    def __init__(self) -> None:
        self._last: dict[str, EngineSnapshot] = {}
        self._retired = EngineSnapshot.zero()
        self._lock = threading.Lock()

    def total(self, answered: dict[str, EngineSnapshot], running: set[str]) -> EngineSnapshot:
        """`answered`: this read's snapshots by replica id; `running`: the replicas asked."""
        with self._lock:
            for replica_id in [r for r in self._last if r not in running]:
                self._retired = EngineSnapshot.total([self._retired, self._last.pop(replica_id).counters_only()])
            self._last.update(answered)
            late = [self._last[r].counters_only() for r in running if r not in answered and r in self._last]
            return EngineSnapshot.total([*answered.values(), *late, self._retired])


class RayEngineClient:
    """The server's engine: a Serve deployment of EngineReplica, behind `handle`."""

    def __init__(self, handle: Any, view: ModelView, app_name: str, deployment_name: str) -> None:
        self._generate = handle.generate.options(stream=True)
        self.engine = view
        self.app_name, self.deployment_name = app_name, deployment_name
        # Per replica id, as this front door sees them: requests now, and since start.
        self.in_flight: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self._ids = itertools.count()
        self.counters = ReplicaCounters()
        self._replicas: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._refresh()
        self._watcher = threading.Thread(target=self._watch, name="ruvllm-replicas", daemon=True)
        self._watcher.start()

    # ---- EngineClient -------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return any(r["state"] == "RUNNING" for r in self._replicas)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, options: RequestOptions,
               loop: asyncio.AbstractEventLoop) -> ReplicaStream:
        ids = self.engine.prepare_prompt(prompt_ids)
        if options.adapter is not None:
            self.engine.adapter(options.adapter)
        return ReplicaStream(self, ReplicaJob(ids, params, options), f"req-{next(self._ids)}")

    def snapshot(self) -> EngineSnapshot:
        """Every running replica's figures, summed, with the counters of replicas gone
        and of those too slow to answer this time (`ReplicaCounters`)."""
        running = self._running_actors()
        calls = {actor.record_routing_stats.remote(): replica_id for replica_id, actor in running}
        ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=SNAPSHOT_TIMEOUT_S)
        answered = {}
        for ref in ready:
            try:
                answered[calls[ref]] = ray.get(ref)["snapshot"]
            except ray.exceptions.RayError:
                continue   # died since: its requests are gone with it
        return self.counters.total(answered, {replica_id for replica_id, _ in running})

    def health(self) -> dict[str, Any]:
        replicas = [{**r, "in_flight": self.in_flight.get(r["replica_id"], 0),
                     "requests": self.served.get(r["replica_id"], 0)} for r in self._replicas]
        states = Counter(r["state"] for r in replicas)
        return {"replicas": replicas, "replica_states": dict(states), "routing": routing_decisions()}

    def call(self, fn: Callable[[Any], Any]) -> Any:
        raise UsageError("loading adapters at run time does not work with --replicas")

    # ---- Ray -----------------------------------------------------------------------
    def call_replica(self, job: ReplicaJob) -> Any:
        return self._generate.remote(job)

    def close(self) -> None:
        """Stop reading the replicas' states (before Ray shuts down: a read after it
        would connect Ray again)."""
        self._stop.set()
        self._watcher.join(STATUS_PERIOD_S + 5)

    def _running_actors(self) -> list[tuple[str, Any]]:
        actors = []
        for replica in self._replicas:
            if replica["state"] == "RUNNING":
                try:
                    actors.append((replica["replica_id"], ray.get_actor(replica["actor_name"], namespace="serve")))
                except ValueError:
                    continue   # gone since the last look
        return actors

    def _watch(self) -> None:
        while not self._stop.wait(STATUS_PERIOD_S):
            try:
                self._refresh()
            except Exception as error:  # noqa: BLE001 - keep the last known states, say why once
                log.warning("cannot read the replicas' states from Ray Serve: %s", error)

    def _refresh(self) -> None:
        from ruvllm_cli.cluster.deploy import replica_details

        self._replicas = replica_details(self.app_name, self.deployment_name)
