"""Ollama's API on the same engine paths as every other route: /api/chat and
/api/generate (routes.generate, streamed as NDJSON), /api/tags, /api/show, /api/ps
and /api/version. Apps written for Ollama (its Python and JavaScript clients,
LangChain's ChatOllama, Open WebUI) point at `ruvllm serve --port 11434` unchanged.

Model management (pull, push, create, copy, delete) stays with the CLI (`ruvllm
download`, `ruvllm rm`), and embeddings are not served: those paths are 404s in
Ollama's shape that say so."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from aiohttp import web

from ruvllm_cli import __version__
from ruvllm_cli.server.body import read_json
from ruvllm_cli.server.expect import expect_continue
from ruvllm_cli.engine.request import RequestOptions
from ruvllm_cli.server.errors import bad_request, json_response
from ruvllm_cli.server.middlewares import ARRIVED
from ruvllm_cli.server.model_entry import ModelEntry, ModelStatus
from ruvllm_cli.server.ollama_api.protocol import OllamaJob, parse_chat, parse_generate, parse_show
from ruvllm_cli.server.ollama_api.responses import Clock, OllamaFormat, timestamp
from ruvllm_cli.server.prompts import SequencePlan, check_constraints, plan_sequences, tokenize_prompts
from ruvllm_cli.server.sse import NDJSONStream
from ruvllm_cli.server.state import ServerState, get_state
from ruvllm_cli.server.tool_output import ToolReplies

# What a 404 under /api/ says: the Ollama routes this server has, and where the rest went.
SERVED = "/api/chat, /api/generate, /api/tags, /api/show, /api/ps and /api/version"
NOT_SERVED_HINT = (f"ruvllm serves Ollama's {SERVED}; models are downloaded with `ruvllm download` and "
                   "removed with `ruvllm rm`, and embeddings are not served.")


def add_ollama_routes(app: web.Application) -> None:
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", running)
    app.router.add_post("/api/show", show, expect_handler=expect_continue)
    app.router.add_post("/api/chat", chat, expect_handler=expect_continue)
    app.router.add_post("/api/generate", generate, expect_handler=expect_continue)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": __version__})


async def chat(request: web.Request) -> web.StreamResponse:
    state = get_state(request.app)
    state.require_ready()
    return await _reply(request, state, parse_chat(await read_json(request, state.config.max_body_size)), "chat")


async def generate(request: web.Request) -> web.StreamResponse:
    state = get_state(request.app)
    state.require_ready()
    job = parse_generate(await read_json(request, state.config.max_body_size))
    return await _reply(request, state, job, "generate")


async def _reply(request: web.Request, state: ServerState, job: OllamaJob, kind: str) -> web.StreamResponse:
    from ruvllm_cli.server.routes import chat_prepare, generate as generate_reply

    started = request.get(ARRIVED) or time.perf_counter()
    name = served_name(state, job.model)
    if job.unload:
        return json_response(_unload(state, name, job, kind))
    async with state.model_for(name) as model:
        clock = Clock(started, time.perf_counter() - started)
        fmt = OllamaFormat(kind, job.model, clock, think=job.think)
        if job.empty:   # Ollama's load request: the model is loaded now
            return json_response({**fmt.reply_object(done=True), "done_reason": "load"})
        if job.think and model.reasoning is None:
            raise bad_request(f"'{job.model}' does not support thinking.", "think", "unsupported_parameter")
        parser = model.require_tool_parser() if job.tools and job.tools.active else None
        sampling = job.sampling if job.length_given else dataclasses.replace(
            job.sampling, default_max_tokens=state.config.chat_max_tokens)
        options = RequestOptions(adapter=model.adapter)
        templated = job.messages is not None and getattr(model.engine.tokenizer, "chat_template", None)
        if templated:
            assert job.messages is not None
            template = job.template
            if job.messages[-1]["role"] == "assistant":   # Ollama continues it (a prefill), not a new turn
                template = dataclasses.replace(template, add_generation_prompt=False, continue_final_message=True)
            prepare = chat_prepare(model.engine, job.messages, job.tools, parser, sampling, options,
                                   template=template, reasoning=model.reasoning)
        else:
            if job.messages is not None and any(m["role"] == "system" for m in job.messages):
                raise bad_request("'system' needs a chat template, and this model has none.", "system")
            prepare = raw_prepare(model.engine, job.prompt, sampling, options)
        fmt.tools = ToolReplies.of(parser, job.tools)
        return await generate_reply(request, state, model, prepare, "messages" if kind == "chat" else "prompt", 1,
                                    fmt, job.stream, sampling.structured, options, writer=NDJSONStream)


def raw_prepare(engine: Any, prompt: str, sampling: Any, options: Any) -> Callable[[], list[SequencePlan]]:
    """/api/generate's prompt as it is (`raw`, or a model without a chat template)."""

    def prepare() -> list[SequencePlan]:
        check_constraints(engine, sampling)
        prompt_ids = tokenize_prompts(engine.tokenizer, [prompt], engine.vocab_size)
        return plan_sequences(prompt_ids, sampling, engine.max_model_len, "prompt", options)

    return prepare


def _unload(state: ServerState, name: str, job: OllamaJob, kind: str) -> dict[str, Any]:
    """Ollama's unload request (no messages, keep_alive 0): a model the server loads on
    demand goes now, or when the requests holding it end."""
    entry, adapter = state.models.find(name)
    if entry.load is None or adapter is not None:
        raise bad_request(f"'{job.model}' stays loaded: this server was started with it. Serve models with "
                          "`ruvllm serve A B ...` to have them loaded and unloaded on demand.", "keep_alive",
                          "invalid_value")
    state.models.unload_when_idle(entry)
    head: dict[str, Any] = {"model": job.model, "created_at": timestamp()}
    head.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
    return {**head, "done": True, "done_reason": "unload"}


def served_name(state: ServerState, name: str) -> str:
    """The served name a request means: Ollama's clients add the default tag, `:latest`."""
    names = set(state.models.all_names())
    if name not in names and name.endswith(":latest") and name.removesuffix(":latest") in names:
        return name.removesuffix(":latest")
    return name


# ---- the models --------------------------------------------------------------------
async def tags(request: web.Request) -> web.Response:
    """Every model served (LoRA adapters as models of their own), loaded or not."""
    state = get_state(request.app)
    state.require_ready()
    return json_response({"models": [model_object(state, entry, name) for entry in state.models.entries
                                     for name in [entry.name, *entry.adapter_names()]]})


async def running(request: web.Request) -> web.Response:
    """The models loaded now, with their memory and when they will be unloaded."""
    state = get_state(request.app)
    state.require_ready()
    models = []
    for entry in state.models.entries:
        if entry.status is not ModelStatus.LOADED or entry.served is None:
            continue
        model = model_object(state, entry, entry.name)
        engine = entry.served.client.engine
        memory = memory_bytes(engine)
        if memory is not None:
            on_gpu = str(getattr(getattr(engine.loaded, "device", None), "type", "cpu")) != "cpu"
            model.update(size=memory, size_vram=memory if on_gpu else 0)
        model["context_length"] = engine.max_model_len
        expires = state.models.expires_at(entry)
        if expires is not None:
            model["expires_at"] = timestamp(expires)
        models.append(model)
    return json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    """A model's details, chat template, architecture figures and capabilities (the
    model is loaded for it, as a request naming it would)."""
    state = get_state(request.app)
    state.require_ready()
    job_name = parse_show(await read_json(request, state.config.max_body_size))
    async with state.model_for(served_name(state, job_name)) as model:
        engine = model.engine
        config = engine.loaded.model.config
        capabilities = ["completion"]
        if model.served.tool_parser is not None:
            capabilities.append("tools")
        if model.reasoning is not None:
            capabilities.append("thinking")
        info = architecture_info(config, engine.max_model_len)
        template = getattr(engine.tokenizer, "chat_template", None)
        return json_response({"modelfile": "", "parameters": "", "template": template if isinstance(template, str)
                              else "", "details": details(model.entry, engine,
                                                          parent=model.entry.name if model.adapter else ""),
                              "model_info": info,
                              "capabilities": capabilities, "modified_at": timestamp(state.wall_started)})


def tagged(name: str) -> str:
    """Ollama's names always carry a tag (`:latest` by default); clients check for it."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def model_object(state: ServerState, entry: ModelEntry, name: str) -> dict[str, Any]:
    engine = entry.served.client.engine if entry.served is not None else None
    return {"name": tagged(name), "model": tagged(name), "modified_at": timestamp(state.wall_started),
            "details": details(entry, engine, parent=entry.name if name != entry.name else "")}


def details(entry: ModelEntry, engine: Any, parent: str = "") -> dict[str, Any]:
    """What Ollama says of a model's kind; what is known of one not loaded: nothing."""
    result: dict[str, Any] = {"parent_model": parent, "format": "", "family": "", "families": None,
                              "parameter_size": "", "quantization_level": ""}
    if engine is None:
        return result
    config = engine.loaded.model.config
    family = getattr(config, "model_type", "") or ""
    quantization = getattr(getattr(engine, "config", None), "quantization", None)
    path = str(getattr(config, "_name_or_path", "") or "")
    result.update(format="gguf" if path.endswith(".gguf") else "safetensors", family=family,
                  families=[family] if family else None,
                  parameter_size=parameter_size(config),
                  quantization_level=getattr(quantization, "value", "") or "")
    return result


def parameter_size(config: Any) -> str:
    """"494.0M", "7.6B": the parameters of the model's shape."""
    from ruvllm_cli.errors import ModelLoadError
    from ruvllm_cli.registry.model_config import count_parameters, shape_from_dict

    try:
        count = count_parameters(shape_from_dict(config.to_dict()))
    except (ModelLoadError, AttributeError, TypeError):
        return ""
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def architecture_info(config: Any, context: int) -> dict[str, Any]:
    """Ollama's `model_info` keys for what a config says (GGUF's metadata names)."""
    arch = getattr(config, "model_type", "") or "unknown"
    info: dict[str, Any] = {"general.architecture": arch}
    for key, attribute in (("context_length", None), ("embedding_length", "hidden_size"),
                           ("block_count", "num_hidden_layers"), ("feed_forward_length", "intermediate_size"),
                           ("attention.head_count", "num_attention_heads"),
                           ("attention.head_count_kv", "num_key_value_heads"), ("vocab_size", "vocab_size")):
        value = context if attribute is None else getattr(config, attribute, None)
        if value is not None:
            info[f"{arch}.{key}"] = value
    return info


def memory_bytes(engine: Any) -> int | None:
    """The model's weights and KV cache in memory (None where the engine runs elsewhere)."""
    from ruvllm_cli.engine.model_runner import kv_bytes_per_block

    weights = getattr(engine.loaded, "weight_bytes", None)
    runner = getattr(engine, "runner", None)
    if weights is None or runner is None:
        return None
    blocks = engine.block_manager.num_blocks
    return weights + blocks * kv_bytes_per_block(engine.loaded.model.config, runner.kv_dtype,
                                                 engine.config.block_size)

