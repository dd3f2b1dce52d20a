"""Between handlers and the engine thread: submit sequences without blocking the
event loop, follow their streams, and cancel whatever a handler leaves behind."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

from ruvllm_cli.engine.lora import AdapterNotFoundError
from ruvllm_cli.engine.outputs import AdapterGoneError, RequestError, RequestOutput
from ruvllm_cli.engine.reasoning import Reasoning, ReasoningSplitter, Split
from ruvllm_cli.engine.request import FinishReason, RequestTimings
from ruvllm_cli.engine.sampler import TokenLogprob
from ruvllm_cli.errors import UsageError
from ruvllm_cli.server.engine_client import EngineClient, EngineStream as RequestStream
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.prompts import SequencePlan


@dataclass
class Choice:
    """One sequence's accumulated output, as a response choice."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_string: str | None = None   # the stop string that ended it, if one did
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    first_token_at: float | None = None
    queue_wait: float | None = None   # seconds from reaching the engine to its first step
    timings: RequestTimings | None = None   # the engine's timestamps, as of the last output that had them
    repaired: bool = False           # json-repair closed a truncated JSON reply
    tool_calls: list[Any] = field(default_factory=list)   # parsed ToolCalls (chat with tools)
    # The span of `text` each token of `logprobs` wrote: from where the token before it
    # ended to where this one ends in what the reply wrote (`RequestOutput.written`: a
    # tail held back as a possible stop string counts, though its step does not show it
    # yet; offsets from what each step showed had lagged behind under `stop`). A skipped
    # special token writes none; a character's first bytes none until its last byte's.
    token_spans: list[tuple[int, int]] = field(default_factory=list)
    _token_end: int = 0
    # A reasoning model's reply: `text` is its answer, `reasoning` what it wrote before.
    reasoning: str = ""
    reasoning_tokens: int | None = 0      # None: its end marker is not one token, so not counted
    markers: Reasoning | None = None
    splitter: ReasoningSplitter | None = None
    on_tokens: Callable[[int], None] | None = None   # told of each output's new tokens (the metrics' counter)

    def add(self, output: RequestOutput) -> Split:
        """Take one output; its text as reasoning and answer (all answer for a model
        without reasoning)."""
        if output.token_ids and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if output.token_ids and self.on_tokens is not None:
            self.on_tokens(len(output.token_ids))
        split = Split(content=output.text)
        if self.splitter is not None:
            split = self.splitter.feed(output.text)
            if output.finished:
                tail = self.splitter.finish()
                split = Split(split.reasoning + tail.reasoning, split.content + tail.content)
            self.reasoning += split.reasoning
        # A reasoning model's answer starts after its reasoning: there the shown text's end
        end = output.written if output.written is not None and self.splitter is None \
            else len(self.text) + len(split.content)
        end = max(end, self._token_end)
        self.token_spans += [(self._token_end, end)] * len(output.logprobs)
        self._token_end = end
        self.text += split.content
        self.token_ids += output.token_ids
        self.logprobs += output.logprobs
        self.num_prompt_tokens = output.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        self.num_output_tokens = output.num_output_tokens or len(self.token_ids)
        # Read from the first output that has it: a client that leaves mid-reply never
        # gets the final one, and its wait in the queue counts all the same.
        timings = output.timings
        self.timings = timings or self.timings
        if self.queue_wait is None and timings is not None and timings.scheduled is not None:
            self.queue_wait = timings.scheduled - timings.arrival
        if output.finished:
            self.finish_reason, self.error = output.finish_reason, output.error
            self.stop_string = output.stop_string
            if self.markers is not None and self.splitter is not None:
                self.reasoning_tokens = self.markers.reasoning_tokens(self.token_ids, self.splitter.had_reasoning)
        return split


def choices_for(plans: Sequence[SequencePlan]) -> list[Choice]:
    return [Choice(plan.index, plan.prompt_index, markers=plan.reasoning,
                   splitter=plan.reasoning.splitter(plan.in_reasoning) if plan.reasoning else None)
            for plan in plans]


class ShuttingDown(Exception):
    """The server's shutdown timeout ran out before these streams ended."""


def shutting_down() -> ApiError:
    return ApiError(503, "The request was cancelled because the server is shutting down.", code="shutting_down")


def check_finished(choice: Choice) -> None:
    """A sequence the engine cancelled (shutdown) or failed becomes an HTTP error."""
    if choice.finish_reason is FinishReason.CANCELLED:
        raise shutting_down()
    if choice.finish_reason is FinishReason.ERROR and isinstance(choice.error, AdapterGoneError):
        raise ApiError(404, str(choice.error), param="model", code="model_not_found")
    if choice.finish_reason is FinishReason.ERROR and isinstance(choice.error, RequestError):
        raise ApiError(400, f"{choice.error[0].upper()}{choice.error[1:]}.", code="invalid_constraint")
    if choice.finish_reason is FinishReason.ERROR:
        raise ApiError(500, f"The engine failed on this request: {choice.error or 'unknown error'}")


# ---- submission -------------------------------------------------------------------
async def submit(engine_loop: EngineClient, executor: Executor, prepare: Callable[[], list[SequencePlan]],
                 param: str) -> tuple[list[SequencePlan], list[RequestStream]]:
    """Run `prepare` (chat template, tokenizing) and submit its plans in a worker
    thread, keeping that CPU work off the event loop."""
    aio = asyncio.get_running_loop()
    future = aio.run_in_executor(executor, _prepare_and_submit, engine_loop, aio, prepare, param)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        # The client left while we were submitting: cancel what the thread submits.
        future.add_done_callback(_cancel_submitted)
        raise


def _prepare_and_submit(engine_loop: EngineClient, aio: asyncio.AbstractEventLoop,
                        prepare: Callable[[], list[SequencePlan]], param: str
                        ) -> tuple[list[SequencePlan], list[RequestStream]]:
    plans = prepare()
    streams: list[RequestStream] = []
    try:
        for plan in plans:
            streams.append(engine_loop.submit(plan.prompt_ids, plan.params, plan.options, aio))
    except AdapterNotFoundError as error:   # unloaded since the handler checked the name
        cancel_all(streams)
        raise ApiError(404, error.message, param="model", code="model_not_found") from error
    except UsageError as error:
        cancel_all(streams)
        raise ApiError.from_ruvllm(error, param) from error
    except BaseException:
        cancel_all(streams)
        raise
    return plans, streams


def _cancel_submitted(future: "asyncio.Future[tuple[list[SequencePlan], list[RequestStream]]]") -> None:
    if not future.cancelled() and future.exception() is None:
        cancel_all(future.result()[1])


def cancel_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        stream.cancel()


# ---- following streams ----------------------------------------------------------------
async def collect(streams: Sequence[RequestStream], choices: Sequence[Choice], stop: asyncio.Event) -> None:
    """Follow every stream to its end, accumulating into the matching choice
    (ShuttingDown once `stop` is set)."""
    events = merged(streams, stop)
    try:
        async for position, output in events:
            choices[position].add(output)
    finally:
        await events.aclose()


async def merged(streams: Sequence[RequestStream], stop: asyncio.Event
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(position in `streams`, output) from all streams, in arrival order, until all
    end; ShuttingDown as soon as `stop` is set, whatever the engine is doing."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(position: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((position, output))
        except Exception as error:  # noqa: BLE001 - re-raised in the consumer
            queue.put_nowait((position, error))

    async def watch() -> None:
        await stop.wait()
        queue.put_nowait((-1, ShuttingDown()))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    tasks.append(asyncio.ensure_future(watch()))
    try:
        remaining = len(streams)
        while remaining:
            position, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield position, item
    finally:
        for task in tasks:
            task.cancel()
