"""LoRA adapters loaded and unloaded at run time: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, with vLLM's names, bodies and answers.

Off unless the server runs with --allow-runtime-lora: loading reads files (or
fetches a hub id) that a request names, which an exposed server must not do for
anyone who can reach it. With --api-key both routes need the key like the rest.

With several models the body's `model` names the base (default: the first); the
pool remembers the adapter, so it comes back when its model is loaded again. The
engine's change and the pool's record happen together even when the client leaves
mid-request (a shielded task), and a name being loaded is reserved until it is done.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from ruvllm_cli.engine.lora import AdapterInUseError, AdapterNotFoundError, read_adapter
from ruvllm_cli.errors import CacheError, DownloadError, RepoUnavailableError, RuvllmError
from ruvllm_cli.registry.adapters import LATEST, LATEST_RULE
from ruvllm_cli.server.body import no_nul, read_json
from ruvllm_cli.server.engine_client import LocalEngine
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.fields import Fields
from ruvllm_cli.server.models import ModelStatus
from ruvllm_cli.server.protocol import LOAD_LORA_FIELDS, UNLOAD_LORA_FIELDS
from ruvllm_cli.server.spec import read_fields
from ruvllm_cli.server.state import ServerState, get_state


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = _runtime_lora(request)
    values = read_fields(Fields(await read_json(request, state.config.max_body_size)), LOAD_LORA_FIELDS)
    name, path = no_nul("lora_name", values["lora_name"]).strip(), no_nul("lora_path", values["lora_path"])
    if not name:   # the rule --lora's names follow
        raise ApiError(400, "'lora_name' must not be blank.", param="lora_name", code="invalid_value")
    if name.endswith(LATEST):
        raise ApiError(400, f"'lora_name': {LATEST_RULE}.", param="lora_name", code="invalid_value")
    if name in state.models.adapters_loading:
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                       code="invalid_value")   # vLLM's words, while its load is still under way too
    if state.models.adapter_owner(name) is not None:
        if values["load_inplace"]:
            return await _replace(state, name, path)
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                       code="invalid_value")
    if name in state.models.all_names():
        raise ApiError(400, f"'{name}' is the name of a model this server serves; give the adapter another "
                            "lora_name.", param="lora_name", code="invalid_value")
    state.models.adapters_loading.add(name)   # until the engine has it or the load failed
    installing: asyncio.Future[None] | None = None
    try:
        located = await _off_loop(state, lambda: _locate(state, path))
        adapter = await _off_loop(state, lambda: read_adapter(name, located))
        async with state.model_for(values["model"] or state.model_name) as model:
            if model.adapter is not None:
                raise ApiError(400, f"'{model.adapter}' is a LoRA adapter; name its base model.", param="model",
                               code="invalid_value")
            client, entry = model.client, model.entry

            async def install() -> None:
                await _off_loop(state, lambda: client.call(lambda engine: engine.add_lora(name, adapter)))
                state.models.keep_adapter(entry, name, located)

            installing = asyncio.ensure_future(install())
            installing.add_done_callback(lambda _: state.models.adapters_loading.discard(name))
            await asyncio.shield(installing)   # a client that leaves does not part engine and record
    except RuvllmError as error:
        raise _api_error(name, error) from error
    finally:
        if installing is None:
            state.models.adapters_loading.discard(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def _replace(state: ServerState, name: str, path: str) -> web.Response:
    """load_inplace on a loaded name: the new weights read, then swapped in on the engine
    thread (Engine.replace_lora); its model is the one the adapter already adapts."""
    entry = state.models.adapter_owner(name)
    assert entry is not None
    state.models.adapters_loading.add(name)
    try:
        located = await _off_loop(state, lambda: _locate(state, path))
        adapter = await _off_loop(state, lambda: read_adapter(name, located))
        if entry.status not in (ModelStatus.UNLOADED, ModelStatus.FAILED):
            async with state.model_for(name) as model:
                client = model.client

                async def swap() -> None:
                    await _off_loop(state, lambda: client.call(lambda engine: engine.replace_lora(name, adapter)))
                    state.models.keep_adapter(entry, name, located)

                await asyncio.shield(asyncio.ensure_future(swap()))
        else:   # an unloaded model's record: it reloads with the new files
            state.models.keep_adapter(entry, name, located)
    except RuvllmError as error:
        raise _api_error(name, error) from error
    finally:
        state.models.adapters_loading.discard(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' replaced successfully.")


def _api_error(name: str, error: RuvllmError) -> ApiError:
    """A load's failure in the API's shape: the hub out of reach or a full disk is the
    server's trouble (503), an adapter in use a 409, the rest the request's (400)."""
    if isinstance(error, AdapterInUseError):
        return ApiError(409, f"The lora adapter '{name}' is in use: {error.message}.", param="lora_name",
                        code="adapter_in_use")
    if isinstance(error, (DownloadError, CacheError)) and not isinstance(error, RepoUnavailableError):
        return ApiError(503, error.message, param="lora_path", code="adapter_download_failed")
    return ApiError(400, error.message, param="lora_path", code="invalid_value")


def _locate(state: ServerState, path: str) -> Path:
    from ruvllm_cli.registry.adapters import locate_adapter

    cache_dir = state.config.cache_dir
    if cache_dir is None and not Path(path).expanduser().is_dir():
        raise ApiError(400, f"'{path}' is not a directory on this server.", param="lora_path", code="invalid_value")
    return locate_adapter(path, Path(cache_dir or "."))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = _runtime_lora(request)
    values = read_fields(Fields(await read_json(request, state.config.max_body_size)), UNLOAD_LORA_FIELDS)
    name = values["lora_name"].strip()   # as the load takes it
    entry = state.models.adapter_owner(name)
    if entry is None:
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="model_not_found")
    try:
        if entry.status not in (ModelStatus.UNLOADED, ModelStatus.FAILED):   # else only its record goes
            async with state.model_for(name) as model:
                client = model.client

                async def remove() -> None:
                    await _off_loop(state, lambda: client.call(lambda engine: engine.remove_lora(name)))
                    entry.adapters.pop(name, None)

                await asyncio.shield(asyncio.ensure_future(remove()))   # engine and record change together
    except AdapterNotFoundError as error:
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                       code="model_not_found") from error
    except AdapterInUseError as error:
        raise ApiError(409, f"The lora adapter '{name}' is in use: {error.message}.", param="lora_name",
                       code="adapter_in_use") from error
    entry.adapters.pop(name, None)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _runtime_lora(request: web.Request) -> ServerState:
    state = get_state(request.app)
    state.require_ready()
    if not state.config.allow_runtime_lora:
        if any(not isinstance(served.client, LocalEngine) for served in state.models.loaded()):   # replicas
            raise ApiError(404, "LoRA adapters cannot be loaded at run time on a server with --replicas; give "
                                "them with --lora when starting it.", code="runtime_lora_disabled")
        raise ApiError(404, "Loading LoRA adapters at run time is off; start the server with "
                            "--allow-runtime-lora.", code="runtime_lora_disabled")
    return state


async def _off_loop(state: ServerState, work: Callable[[], Any]) -> Any:
    """File reads, a download and the wait for the engine thread stay off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(state.executor, work)
