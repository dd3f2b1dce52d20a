"""Runs an LLMEngine in a background thread and streams each request's outputs.

Callers (chat, benchmark: plain iterators; the server: async iterators) submit
requests from any thread; only the engine thread touches the engine. torch releases
the GIL in its kernels, so an asyncio server stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import threading
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.lora import AdapterNotFoundError
from ruvllm_cli.engine.outputs import AdapterGoneError, RequestOutput
from ruvllm_cli.engine.request import FinishReason, RequestOptions
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.errors import RuvllmError

_STOP = object()


class EngineFailedError(RuvllmError):
    """The engine thread died; nothing more can be generated."""

    http_status = 503


class RequestStream:
    """One request's outputs, in order, ending with a `finished` output."""

    def __init__(self, loop: "EngineLoop", request_id: str, aio: asyncio.AbstractEventLoop | None) -> None:
        self.request_id = request_id
        self._engine_loop = loop
        self._aio = aio
        self._sync: queue.Queue[RequestOutput] = queue.Queue()
        self._async: asyncio.Queue[RequestOutput] | None = asyncio.Queue() if aio else None
        self.finished = False

    def _deliver(self, output: RequestOutput) -> None:  # engine thread
        if self._aio is not None:
            assert self._async is not None
            try:
                self._aio.call_soon_threadsafe(self._async.put_nowait, output)
            except RuntimeError:
                pass  # the caller's event loop is gone: nobody is listening any more
        else:
            self._sync.put(output)

    def cancel(self) -> None:
        """Stop generating; the stream still ends with a final `cancelled` output."""
        if not self.finished:
            self._engine_loop.abort(self.request_id)

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            output = self._sync.get()
            self.finished = output.finished
            yield output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        assert self._async is not None, "create the stream with submit_async for async iteration"
        while not self.finished:
            output = await self._async.get()
            self.finished = output.finished
            yield output


class EngineLoop:
    """The engine thread: applies submitted commands, then steps while there is work."""

    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        """`on_failure(error)` runs on the engine thread once it has died: a server
        uses it to exit non-zero, so a supervisor restarts it."""
        self.engine = engine
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._on_step = on_step
        self._on_failure = on_failure
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="ruvllm-engine", daemon=True)
        self._error: BaseException | None = None
        self._thread.start()

    # ---- submission (any thread) -------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               options: RequestOptions | None = None, loop: asyncio.AbstractEventLoop | None = None,
               **fields: Any) -> RequestStream:
        """Queue a request and return its stream at once, without waiting for the
        engine thread (a step can take a while). A bad prompt raises UsageError here.

        With `loop`, the stream is for `async for` on that event loop; any thread may
        call this either way. `options` (or its fields as keywords) as for
        `LLMEngine.add_request`."""
        if self._error is not None:
            raise EngineFailedError(f"the engine has stopped after an error: {self._error}")
        prompt_ids = self.engine.prepare_prompt(prompt)
        options = dataclasses.replace(options or RequestOptions(), **fields)
        if options.adapter is not None:
            self.engine.adapter(options.adapter)   # an unknown name fails here, in the caller's thread
        params = params or SamplingParams()
        stream = RequestStream(self, f"req-{next(self._ids)}", loop)
        self._commands.put(_Add(self, stream, prompt_ids, params, options))
        if self._error is not None:  # died while we queued: the thread may never see it
            stream._deliver(_failed(stream.request_id, self._error))
        return stream

    def submit_async(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     options: RequestOptions | None = None, **fields: Any) -> RequestStream:
        """`submit` for the running event loop's own thread."""
        return self.submit(prompt, params, options, asyncio.get_running_loop(), **fields)

    @property
    def healthy(self) -> bool:
        """False once the engine thread has died (an error in a step)."""
        return self._error is None and self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self._deliver(self.engine.abort(request_id)))

    def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread and return its result (for stats, checks)."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn(self.engine)
            except BaseException as error:  # noqa: BLE001
                box["error"] = error
            done.set()

        self._commands.put(run)
        while not done.wait(0.25):
            if not self.healthy:
                raise EngineFailedError(f"the engine has stopped after an error: {self._error}")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def shutdown(self, timeout: float | None = None) -> bool:
        """Cancel what is left, and stop the thread: wait for it at most `timeout`
        seconds (it finishes its current step first); whether it has stopped."""
        self._commands.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the engine thread -------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished
                if not self._drain(block):
                    break
                if self.engine.has_unfinished:
                    for output in self.engine.step():
                        self._deliver(output)
                    if self._on_step:
                        self._on_step(self.engine)
        except BaseException as error:  # noqa: BLE001 - every waiting stream must hear of it
            self._error = error
            self._fail_all(error)
            if self._on_failure is not None:
                self._on_failure(error)

    def _drain(self, block: bool) -> bool:
        """Apply pending commands; False when asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                for request_id in list(self._streams):
                    self._deliver(self.engine.abort(request_id))
                return False
            command()

    def _deliver(self, output: RequestOutput | None) -> None:
        if output is None:
            return
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            del self._streams[output.request_id]
        stream._deliver(output)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            stream._deliver(_failed(request_id, error))
        self._streams.clear()
        while True:  # requests queued but never added hear of it too
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.stream._deliver(_failed(command.stream.request_id, error))


class _Add:
    """The engine-thread half of `EngineLoop.submit`."""

    def __init__(self, loop: EngineLoop, stream: RequestStream, prompt_ids: list[int],
                 params: SamplingParams, options: RequestOptions) -> None:
        self.loop, self.stream = loop, stream
        self.prompt_ids, self.params, self.options = prompt_ids, params, options

    def __call__(self) -> None:
        stream = self.stream
        try:
            self.loop.engine.add_request(self.prompt_ids, self.params, request_id=stream.request_id,
                                         options=self.options)
        except AdapterNotFoundError as error:   # unloaded since `submit` checked the name
            stream._deliver(RequestOutput(request_id=stream.request_id, token_ids=[], text="", finished=True,
                                          finish_reason=FinishReason.ERROR, error=AdapterGoneError(error.message)))
            return
        except Exception as error:  # noqa: BLE001 - the stream ends with it instead
            stream._deliver(_failed(stream.request_id, error, prefix=""))
            return
        self.loop._streams[stream.request_id] = stream


def _failed(request_id: str, error: BaseException, prefix: str = "engine failure: ") -> RequestOutput:
    return RequestOutput(request_id=request_id, token_ids=[], text="", finished=True,
                         finish_reason=FinishReason.ERROR, error=f"{prefix}{error}")
