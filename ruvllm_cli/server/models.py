"""Several models behind one server (docs/design.md, section 17): a pool that loads a
model on the first request naming it, unloads the least recently used idle one to make
room (`--models-max`), and unloads a model idle for `--keep-alive`.

A request holds its model with `ModelPool.lease` for as long as it runs, so a model is
never unloaded under a request. The pool's state is only touched on the app's event
loop; a load runs in a daemon thread, a release in the executor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from ruvllm_cli.engine.loop import EngineLoop
from ruvllm_cli.errors import RuvllmError
from ruvllm_cli.registry.adapters import LATEST
from ruvllm_cli.server.engine_client import EngineClient
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.metrics import EngineSnapshot
from ruvllm_cli.server.model_entry import (OCCUPYING, Lease, Loader, ModelEntry, ModelSpec, ModelStatus,
                                          PoolSettings, ServedModel)
from ruvllm_cli.server.model_memory import release_engine

__all__ = ["Lease", "Loader", "ModelEntry", "ModelPool", "ModelSpec", "ModelStatus", "PoolSettings", "ServedModel"]

log = logging.getLogger("ruvllm.server")
# What a request waiting for a slot that busy models hold is told to wait before retrying.
BUSY_RETRY_AFTER_S = 5


class ModelPool:
    """Every model of one server, by name; loads and unloads them as requests come."""

    def __init__(self, tool_call_parser: str | None, executor: Executor, reasoning_parser: str = "auto",
                 model_sampling: bool = True) -> None:
        self.entries: list[ModelEntry] = []
        self.settings = PoolSettings()
        self.report: Callable[[str], None] = log.info   # one line per load failure and unload
        self._parser = tool_call_parser
        self._reasoning_parser = reasoning_parser
        self._model_sampling = model_sampling
        self.adapters_loading: set[str] = set()   # names a runtime load has reserved
        self._draining = False
        self._executor = executor
        self._change = asyncio.Event()
        self._tasks: set[asyncio.Future[Any]] = set()
        self._closed = False
        # The counters of the engines unloaded so far: /metrics adds them in, so that a
        # counter summed over the loaded engines never goes back when one unloads.
        self.retired = EngineSnapshot.zero()

    # ---- the models ----------------------------------------------------------------------
    def attach(self, names: Sequence[str], client: EngineClient, path: Path | None = None) -> None:
        """A model loaded by someone else, who also stops it: never unloaded. `path`: its
        directory or GGUF file (Ollama's /api/tags gives its size and digest)."""
        served = ServedModel(client, self._parser, self._reasoning_parser, self._model_sampling)
        self._add(ModelEntry(tuple(names), None, status=ModelStatus.LOADED, served=served, path=path))

    def add(self, spec: ModelSpec) -> None:
        """A model loaded on the first request that names it."""
        from ruvllm_cli.engine.stream_load import keep_returning_freed_memory

        keep_returning_freed_memory()   # models come and go here: their memory must go back
        self._add(ModelEntry(spec.names, spec.load, dict(spec.adapters), path=spec.path))

    def _add(self, entry: ModelEntry) -> None:
        taken = set(self.all_names())
        clash = [name for name in [*entry.names, *entry.adapter_names()] if name in taken]
        if clash or not entry.names:
            raise ValueError(f"model names must be unique and given: {clash or entry.names}")
        self.entries.append(entry)

    def all_names(self) -> list[str]:
        return [name for entry in self.entries for name in [*entry.names, *entry.adapter_names()]]

    def served_name(self, name: str) -> str:
        """The served name (a model's or an adapter's) a request's `model` means: itself,
        or where it is not served, the name without Ollama's default tag (`tiny:latest`,
        as /api/tags lists it), on every API (Ollama's own /v1 takes it: clients that
        list models through /api/tags send it to /v1/chat/completions)."""
        names = self.all_names()
        if name not in names and name.endswith(LATEST) and name.removesuffix(LATEST) in names:
            return name.removesuffix(LATEST)
        return name

    def find(self, name: str) -> tuple[ModelEntry, str | None]:
        """The model a request's `model` names (`served_name`) and the LoRA adapter it
        names (None: the base model); a 404 listing what is served for any other name."""
        served = self.served_name(name)
        for entry in self.entries:
            if served in entry.names:
                return entry, None
            if served in entry.adapter_names():
                return entry, served
        raise ApiError(404, f"The model '{name}' does not exist. This server serves: "
                            f"{', '.join(self.all_names())}.", param="model", code="model_not_found")

    def adapter_owner(self, name: str) -> ModelEntry | None:
        """The model whose LoRA adapter `name` is."""
        return next((entry for entry in self.entries if name in entry.adapter_names()), None)

    def keep_adapter(self, entry: ModelEntry, name: str, path: Path) -> None:
        """An adapter loaded at run time, to load again whenever its model loads."""
        entry.adapters[name] = path

    def loaded(self) -> list[ServedModel]:
        return [entry.served for entry in self.entries if entry.served is not None]

    @property
    def healthy(self) -> bool:
        return all(served.client.healthy for served in self.loaded())

    def health(self) -> dict[str, Any]:
        """The fields the loaded models' clients add to /health (the replicas' states
        behind --replicas, which serves one model)."""
        extra: dict[str, Any] = {}
        for served in self.loaded():
            extra.update(served.client.health())
        return extra

    # ---- leases --------------------------------------------------------------------------
    @asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[Lease]:
        """The model `name` names, loaded (and waited for) if need be, held until the
        block ends: 404 for an unknown name, 503 with Retry-After when it cannot load."""
        entry, adapter = self.find(name)
        entry.in_flight += 1
        entry.cancel_timer()
        lease = None
        try:
            lease = Lease(entry, await self._ready(entry), adapter)
            entry.last_used = time.monotonic()
            yield lease
        finally:
            if lease is not None:
                lease.release()
            entry.in_flight -= 1
            entry.last_used = time.monotonic()
            if not entry.in_flight:
                self._notify()
                self._idle(entry)

    async def _ready(self, entry: ModelEntry) -> ServedModel:
        """Wait until `entry` is loaded, loading it (and unloading another) if need be."""
        deadline: float | None = None
        while True:
            if self._draining:   # not admitted yet, so the shutdown would not wait for it: answered now
                raise ApiError(503, "The request was cancelled because the server is shutting down.",
                               code="shutting_down")
            if entry.status is ModelStatus.LOADED:
                assert entry.served is not None
                return entry.served
            if entry.status not in (ModelStatus.UNLOADED, ModelStatus.FAILED):
                deadline = None   # its own load or unload is under way: worth waiting for
            else:
                self._check_failed(entry)
                if self._has_room():
                    self._start(self._load(entry), entry, ModelStatus.LOADING)
                    continue
                victim = self._victim()
                if victim is not None:
                    self._start_unload(victim, f"to make room for {entry.name}")
                elif deadline is None:   # every loaded model is busy: wait for one, but not forever
                    deadline = time.monotonic() + self.settings.slot_timeout
            if not await self._changed(deadline):
                raise self._busy(entry)

    def _check_failed(self, entry: ModelEntry) -> None:
        """A load that failed lately fails its requests at once, with when to retry."""
        wait = entry.failed_at + self.settings.retry_after - time.monotonic()
        if entry.status is ModelStatus.FAILED and wait > 0:
            raise ApiError(503, f"The model '{entry.name}' failed to load: {entry.error}", code="model_load_failed",
                           headers={"Retry-After": str(max(1, round(wait)))})

    def _busy(self, entry: ModelEntry) -> ApiError:
        limit = self.settings.max_loaded
        return ApiError(503, f"The model '{entry.name}' cannot be loaded now: the {limit} loaded models "
                             f"(--models-max {limit}) are all busy; retry shortly.", code="models_busy",
                        headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})

    def _has_room(self) -> bool:
        limit = self.settings.max_loaded
        return limit is None or sum(entry.status in OCCUPYING for entry in self.entries) < limit

    def _victim(self) -> ModelEntry | None:
        """The least recently used loaded model that no request holds."""
        idle = [entry for entry in self.entries if entry.status is ModelStatus.LOADED and not entry.in_flight
                and entry.load is not None]
        return min(idle, key=lambda entry: entry.last_used, default=None)

    # ---- changes -------------------------------------------------------------------------
    def _notify(self) -> None:
        """Wake every request waiting for the pool to change."""
        self._change.set()
        self._change = asyncio.Event()

    async def _changed(self, deadline: float | None) -> bool:
        """Until the next change (True), or False once `deadline` has passed."""
        change = self._change
        timeout = None if deadline is None else deadline - time.monotonic()
        if timeout is not None and timeout <= 0:
            return False
        try:
            await asyncio.wait_for(change.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _start(self, work: Any, entry: ModelEntry, status: ModelStatus) -> None:
        entry.status = status   # at once: the next request must see it
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- loading and unloading ---------------------------------------------------------
    async def _load(self, entry: ModelEntry) -> None:
        assert entry.load is not None
        load, adapters = entry.load, list(entry.adapters.items())
        try:
            served = await in_daemon_thread(lambda: self._serve(load(adapters)))
        except Exception as error:  # noqa: BLE001 - every request for it answers with it
            entry.status, entry.error, entry.failed_at = ModelStatus.FAILED, one_line(error), time.monotonic()
            entry.unload_asked = False   # asked of this load, which left nothing: not of the next one
            entry.counts["load_failures"] += 1
            self.report(f"{entry.name} failed to load: {entry.error}")
        else:
            if self._closed:   # the server stopped while it loaded
                served.shutdown(0)
                return
            entry.status, entry.served, entry.error = ModelStatus.LOADED, served, None
            entry.counts["loads"] += 1
            serving = set(served.client.engine.lora.names())
            for name in [name for name in entry.adapters if name not in serving]:
                del entry.adapters[name]   # its loader left it out (unreadable, another base): gone for good
                self.report(f"{entry.name}: LoRA adapter {name} did not load with it and is no longer served")
        self._notify()
        self._idle(entry)

    def _serve(self, engine_loop: EngineLoop) -> ServedModel:
        try:
            return ServedModel(engine_loop, self._parser, self._reasoning_parser, self._model_sampling)
        except BaseException:
            engine_loop.shutdown(0)   # no thread left behind by a model that is not served
            raise

    def _idle(self, entry: ModelEntry) -> None:
        """Arm the keep-alive unload of a loaded model that no request holds."""
        keep_alive = self.settings.keep_alive
        if entry.in_flight or entry.status is not ModelStatus.LOADED or entry.load is None or self._closed:
            return
        entry.cancel_timer()
        if entry.unload_asked:
            self._start_unload(entry, "a client asked for it")
        elif keep_alive == 0:
            self._start_unload(entry, "its last request ended")
        elif keep_alive is not None:
            entry.timer = asyncio.get_running_loop().call_later(keep_alive, self._expire, entry)
            entry.timer_due = time.time() + keep_alive

    def unload_when_idle(self, entry: ModelEntry) -> None:
        """Unload a model the pool loaded: now if no request holds it, else when the last ends."""
        if entry.status in (ModelStatus.LOADING, ModelStatus.LOADED):
            entry.unload_asked = True
            self._idle(entry)

    def expires_at(self, entry: ModelEntry) -> float | None:
        """When a loaded model's keep-alive unloads it (time.time()): None if it never does;
        a model in use is kept --keep-alive past now at least."""
        keep_alive = self.settings.keep_alive
        if entry.load is None or keep_alive is None:
            return None
        return entry.timer_due if entry.timer is not None else time.time() + keep_alive

    def _expire(self, entry: ModelEntry) -> None:
        entry.timer = None
        if not entry.in_flight and entry.status is ModelStatus.LOADED:
            self._start_unload(entry, f"idle for {duration_text(self.settings.keep_alive or 0)}")

    def _start_unload(self, entry: ModelEntry, reason: str) -> None:
        entry.cancel_timer()
        self._start(self._unload(entry, reason), entry, ModelStatus.UNLOADING)

    async def _unload(self, entry: ModelEntry, reason: str) -> None:
        # Its counts are read while it is still listed, then it leaves the list and they
        # join `retired` in one step, so a /metrics scrape counts them once, never twice
        # nor not at all (a counter had gone back across each unload: a helper's pass).
        try:
            final = await asyncio.get_running_loop().run_in_executor(self._executor, final_counts, entry.served)
            if entry.served is not None:
                entry.served.final_counts = final
            # The only reference left goes into the box, which the release empties before
            # collecting: a local here would keep the whole model alive through the collection.
            box, entry.served = [entry.served], None
            if final is not None:
                self.retired = EngineSnapshot.total([self.retired, final])
            await asyncio.get_running_loop().run_in_executor(self._executor, release_engine, box)
        finally:
            entry.status, entry.unload_asked = ModelStatus.UNLOADED, False
            entry.counts["unloads"] += 1
            self.report(f"Unloaded {entry.name} ({reason})")
            self._notify()

    def drain(self) -> None:
        """The server is stopping: requests waiting for a model get a 503 now."""
        self._draining = True
        self._notify()

    def close(self, timeout: float) -> None:
        """Stop the engines the pool loaded (each waited for at most `timeout` s)."""
        self._closed = True
        for entry in self.entries:
            entry.cancel_timer()
            if entry.load is not None and entry.served is not None:
                entry.served.shutdown(timeout)
                entry.served, entry.status = None, ModelStatus.UNLOADED


def final_counts(served: ServedModel | None) -> EngineSnapshot | None:
    """An engine's counters as it is unloaded (read on its thread); None if it cannot answer."""
    try:
        return served.client.snapshot().counters_only() if served is not None else None
    except Exception:  # noqa: BLE001 - a dead engine's counts are lost with it, as its model is
        return None


def in_daemon_thread(fn: Callable[[], Any]) -> "asyncio.Future[Any]":
    """`fn()` in a daemon thread: a signal during a long load must still end the
    process (an executor's thread is waited for at exit)."""
    aio = asyncio.get_running_loop()
    future: asyncio.Future[Any] = aio.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def target() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as raised:  # noqa: BLE001 - handed to the event loop
            error = raised
        try:
            aio.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass   # the event loop has closed: nobody waits for the model any more

    threading.Thread(target=target, name="ruvllm-load", daemon=True).start()
    return future


def duration_text(seconds: float) -> str:
    """300 -> 5m, 30 -> 30s, 5400 -> 90m: as a user would type it."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def one_line(error: BaseException) -> str:
    """A load error as one line for an API answer (our own errors' message as is)."""
    if isinstance(error, RuvllmError):
        return error.message
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
