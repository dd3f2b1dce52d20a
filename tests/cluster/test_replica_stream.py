"""How the front door's ReplicaStream reads Ray's errors (no cluster needed: a scripted
call stands in for Serve's DeploymentResponseGenerator)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ruvllm_cli.cluster.client import ReplicaStream  # noqa: E402
from ruvllm_cli.cluster.replica import ReplicaHello  # noqa: E402
from ruvllm_cli.engine.outputs import RequestOutput  # noqa: E402
from ruvllm_cli.engine.request import FinishReason  # noqa: E402
from ruvllm_cli.server.errors import ApiError  # noqa: E402


class Call:
    """Yields `items` in turn; an exception among them is raised there."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)

    def __aiter__(self) -> "Call":
        return self

    async def __anext__(self) -> Any:
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        pass


class Client:
    def __init__(self, calls: list[list[Any]]) -> None:
        self.calls = [Call(items) for items in calls]
        self.in_flight: Counter[str] = Counter()
        self.served: Counter[str] = Counter()

    def call_replica(self, job: Any) -> Call:
        return self.calls.pop(0)


def collect(client: Client) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [output async for output in ReplicaStream(client, None, "req-0")]  # type: ignore[arg-type]

    return asyncio.run(run())


HELLO = ReplicaHello("r1", 1234)
DONE = RequestOutput("req-0", [5], "hi", finished=True, finish_reason=FinishReason.STOP)


def oom() -> BaseException:
    return ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory. " + "x" * 1000)


def test_a_replica_the_memory_monitor_killed_before_its_hello_is_sent_again() -> None:
    client = Client([[oom()], [ray.exceptions.WorkerCrashedError()], [HELLO, DONE]])
    assert [o.text for o in collect(client)] == ["hi"]
    assert client.served == {"r1": 1} and client.in_flight == {"r1": 0}


def test_a_replica_killed_mid_stream_is_a_503_not_a_500() -> None:
    """A helper's pass: Ray's OutOfMemoryError was not caught, and the front door wrote a
    500 into the stream's body."""
    first = RequestOutput("req-0", [5], "h")
    for lost in (oom(), ray.exceptions.NodeDiedError("node gone"), ray.exceptions.ActorDiedError()):
        with pytest.raises(ApiError) as caught:
            collect(Client([[HELLO, first, lost]]))
        assert caught.value.status == 503 and caught.value.code == "replica_unavailable"
    with pytest.raises(ApiError, match="stopped"):
        collect(Client([[oom()], [oom()], [oom()]]))   # RESEND_LIMIT passed


def test_an_error_the_replica_s_code_raised_fails_the_request_alone() -> None:
    failed = ray.exceptions.RayTaskError("generate", "Traceback ...", ValueError("bad step"))
    [output] = collect(Client([[HELLO, failed]]))
    assert output.finished and output.finish_reason is FinishReason.ERROR


def test_engine_counters_never_go_back_as_replicas_come_and_go() -> None:
    """A helper's pass: engine_steps_total went 4,244 -> 1,902 when a replica was replaced
    (its counts left the sum), and dipped whenever one answered too late."""
    from ruvllm_cli.cluster.client import ReplicaCounters
    from ruvllm_cli.server.metrics import EngineSnapshot

    def snap(steps: int, running: int = 1) -> EngineSnapshot:
        return EngineSnapshot(**{**vars(EngineSnapshot.zero()), "steps": steps, "running": running})

    counters = ReplicaCounters()
    assert counters.total({"a": snap(100), "b": snap(50)}, {"a", "b"}).steps == 150
    late = counters.total({"a": snap(120)}, {"a", "b"})         # b too slow: its last counters stand in
    assert (late.steps, late.running) == (170, 1)
    replaced = counters.total({"a": snap(130), "c": snap(5)}, {"a", "c"})   # b gone, c new
    assert replaced.steps == 185 and replaced.running == 2
    assert counters.total({"a": snap(140), "c": snap(9)}, {"a", "c"}).steps == 199
