"""Streaming through the engine thread: sync and async iterators, cancellation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.engine.loop import EngineLoop
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.errors import UsageError

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def loop(make_engine):
    engine_loop = EngineLoop(make_engine())
    yield engine_loop
    engine_loop.shutdown()


def test_sync_stream_yields_every_token_then_a_final_output(loop):
    stream = loop.submit([5, 6, 7, 8], PARAMS)
    outputs = list(stream)
    assert sum(len(o.token_ids) for o in outputs) == 12
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert outputs[0].timings.first_token is not None


def test_stream_matches_the_engine_alone(loop, make_engine):
    expected = make_engine().generate([[9, 10, 11]], PARAMS)[0]
    outputs = list(loop.submit([9, 10, 11], PARAMS))
    assert [t for o in outputs for t in o.token_ids] == expected.token_ids
    assert "".join(o.text for o in outputs) == expected.text


def test_async_streams_run_concurrently_and_cancel_alone(loop):
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def consume(stream, cancel_after=None):
        tokens = []
        async for out in stream:
            tokens += out.token_ids
            if cancel_after is not None and len(tokens) >= cancel_after:
                stream.cancel()
                cancel_after = None
            last = out
        return tokens, last.finish_reason

    async def main():
        streams = [loop.submit_async([20 + i, 30, 40], long if i == 0 else PARAMS) for i in range(4)]
        return await asyncio.gather(consume(streams[0], cancel_after=3), *(consume(s) for s in streams[1:]))

    results = asyncio.run(main())
    tokens, reason = results[0]
    assert reason is FinishReason.CANCELLED and 3 <= len(tokens) < 200
    assert all(r is FinishReason.LENGTH and len(t) == 12 for t, r in results[1:])
    loop.call(lambda engine: engine.block_manager.check_integrity([]))
    steps = loop.call(lambda engine: engine.stats.steps)
    assert steps < 12 + 10  # the four streams shared their steps


def test_bad_request_raises_in_the_caller(loop):
    with pytest.raises(UsageError):
        loop.submit([], PARAMS)


def test_submit_returns_without_waiting_for_a_step(loop):
    """A long step in progress must not block the caller (the server's event loop)."""
    import time

    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    running = loop.submit([5 + i % 500 for i in range(600)], long)
    started = time.perf_counter()
    streams = [loop.submit([7, 8, 9], PARAMS) for _ in range(20)]
    assert time.perf_counter() - started < 0.5
    for stream in streams:
        assert list(stream)[-1].finish_reason is FinishReason.LENGTH
    running.cancel()
    assert list(running)[-1].finish_reason is FinishReason.CANCELLED


def test_a_failed_engine_is_reported_not_hung(make_engine):
    engine = make_engine()
    engine_loop = EngineLoop(engine)

    def explode():
        raise RuntimeError("boom")

    engine.step = explode  # the next step fails
    stream = engine_loop.submit([5, 6, 7], PARAMS)
    final = list(stream)[-1]
    assert final.finish_reason is FinishReason.ERROR and "boom" in final.error
    assert not engine_loop.healthy
    with pytest.raises(Exception, match="stopped"):
        engine_loop.submit([5, 6, 7], PARAMS)
    engine_loop.shutdown()


def test_a_dead_engine_reports_through_on_failure(make_engine):
    engine = make_engine()
    failures = []

    def explode(chunks):
        raise RuntimeError("device lost")

    engine.runner.execute = explode
    engine_loop = EngineLoop(engine, on_failure=failures.append)
    # a forward that raises once fails its requests; twice in a row, the engine
    outputs = list(engine_loop.submit([5, 6, 7], PARAMS))
    assert outputs[-1].finish_reason is FinishReason.ERROR and "device lost" in outputs[-1].error
    assert engine_loop.healthy and not failures
    outputs = list(engine_loop.submit([5, 6, 7], PARAMS))
    engine_loop._thread.join(5)
    assert outputs[-1].finish_reason is FinishReason.ERROR and "device lost" in outputs[-1].error
    assert [str(f) for f in failures] == ["device lost"]
    assert not engine_loop.healthy


def test_shutdown_waits_at_most_its_timeout_for_a_step_in_progress(loop):
    entered, release = threading.Event(), threading.Event()

    def long_step(engine) -> None:
        entered.set()
        release.wait(10)

    busy = threading.Thread(target=lambda: loop.call(long_step))
    busy.start()
    assert entered.wait(5)   # the engine thread is now stuck in a long "step"
    started = time.monotonic()
    assert loop.shutdown(timeout=0.2) is False
    assert time.monotonic() - started < 1
    release.set()
    assert loop.shutdown(timeout=5) is True
    busy.join(5)
