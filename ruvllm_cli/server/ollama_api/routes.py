"""Ollama's API on the same engine paths as every other route: /api/chat and
/api/generate (routes.generate, streamed as NDJSON), /api/tags, /api/show, /api/ps
and /api/version. Apps written for Ollama (its Python and JavaScript clients,
LangChain's ChatOllama, Open WebUI) point at `ruvllm serve --port 11434` unchanged.

Model management (pull, push, create, copy, delete) stays with the CLI (`ruvllm
download`, `ruvllm rm`), and embeddings are not served: those paths are 404s in
Ollama's shape that say so."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aiohttp import web

from ruvllm_cli import __version__
from ruvllm_cli.server.body import read_json
from ruvllm_cli.server.expect import expect_continue
from ruvllm_cli.engine.request import RequestOptions
from ruvllm_cli.server.errors import ApiError, bad_request, json_response
from ruvllm_cli.server.middlewares import ARRIVED
from ruvllm_cli.server.model_entry import ModelEntry, ModelStatus
from ruvllm_cli.server.ollama_api.protocol import OLLAMA_SAMPLING, OllamaJob, parse_chat, parse_generate, parse_show
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


# The Ollama release whose API these routes answer as (`think` levels, `tool_name`,
# `format` schemas: 0.11's). Clients read `version` as Ollama's and some refuse an old
# one (VS Code's Copilot Chat asks for 0.6.4 or later): ruvllm's own 0.1.0 there read
# as an Ollama from 2023. ruvllm's version is beside it.
OLLAMA_API_VERSION = "0.11.0"


async def version(request: web.Request) -> web.Response:
    return json_response({"version": OLLAMA_API_VERSION, "ruvllm_version": __version__})


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
    name = state.models.served_name(job.model)
    if job.unload:
        return json_response(_unload(state, name, job, kind))
    asked = time.perf_counter()
    async with state.model_for(name) as model:
        clock = Clock(started, time.perf_counter() - asked)   # the wait for the model alone
        fmt = OllamaFormat(kind, job.model, clock, think=job.think)
        if job.empty:   # Ollama's load request: the model is loaded now
            return json_response({**fmt.reply_object(done=True), "done_reason": "load"})
        if job.think and model.reasoning is None:
            raise bad_request(f"'{job.model}' does not support thinking.", "think", "unsupported_parameter")
        parser = model.require_tool_parser() if job.tools and job.tools.active else None
        sampling = job.sampling if job.length_given else dataclasses.replace(
            job.sampling, default_max_tokens=state.config.chat_max_tokens)
        # Unset options: the model's recommendation, else Ollama's own defaults.
        sampling = sampling.with_defaults({**OLLAMA_SAMPLING, **model.sampling_defaults})
        options = RequestOptions(adapter=model.adapter)
        templated = job.messages is not None and getattr(model.engine.tokenizer, "chat_template", None)
        if templated:
            assert job.messages is not None
            template = job.template
            if job.messages[-1]["role"] == "assistant":   # Ollama continues it (a prefill), not a new turn
                template = dataclasses.replace(template, add_generation_prompt=False, continue_final_message=True)
            prepare = fitted(job.messages, lambda messages: chat_prepare(
                model.engine, messages, job.tools, parser, sampling, options, template=template,
                reasoning=model.reasoning))
        elif kind == "chat":
            raise bad_request("This model has no chat template; /api/generate takes its prompt as written.",
                              "messages")
        else:
            if job.messages is not None and any(m["role"] == "system" for m in job.messages):
                raise bad_request("'system' needs a chat template, and this model has none.", "system")
            prepare = raw_prepare(model.engine, job.prompt, sampling, options)
        fmt.tools = ToolReplies.of(parser, job.tools)
        return await generate_reply(request, state, model, prepare, "messages" if kind == "chat" else "prompt", 1,
                                    fmt, job.stream, sampling.structured, options, writer=NDJSONStream)


def fitted(messages: list[dict[str, Any]],
           prepare_for: Callable[[list[dict[str, Any]]], Callable[[], list[SequencePlan]]]
           ) -> Callable[[], list[SequencePlan]]:
    """The chat's preparation, its oldest messages dropped (in the worker thread) while the
    conversation leaves no room in the context: Ollama's `truncate`, which keeps the system
    prompt and the conversation's end, so a long chat goes on instead of failing. The
    conversation is rendered once where it fits (the common case), again per drop where not."""

    def prepare() -> list[SequencePlan]:
        kept = list(messages)
        while True:
            try:
                return prepare_for(kept)()
            except ApiError as error:
                # only the last message left: the usual 400, as Ollama's when that alone is too long
                if error.code != "context_length_exceeded" or not drop_oldest(kept):
                    raise

    return prepare


def drop_oldest(messages: list[dict[str, Any]]) -> bool:
    """Drop the oldest turn beside the system prompt (False: only the last message is left);
    the rest opens with the user's turn, as a tool result or reply without it would be orphaned."""
    dropped = False
    while True:
        rest = [i for i, m in enumerate(messages) if m["role"] != "system"]
        if len(rest) <= 1 or (dropped and messages[rest[0]]["role"] == "user"):
            return dropped
        del messages[rest[0]]
        dropped = True


def raw_prepare(engine: Any, prompt: str, sampling: Any, options: Any) -> Callable[[], list[SequencePlan]]:
    """/api/generate's prompt as it is (`raw`, or a model without a chat template)."""

    def prepare() -> list[SequencePlan]:
        checked = check_constraints(engine, sampling)
        prompt_ids = tokenize_prompts(engine.tokenizer, [prompt], engine.vocab_size)
        return plan_sequences(prompt_ids, checked, engine.max_model_len, "prompt", options)

    return prepare


def _unload(state: ServerState, name: str, job: OllamaJob, kind: str) -> dict[str, Any]:
    """Ollama's unload request (no messages, keep_alive 0): a model the server loads on
    demand goes now, or when the requests holding it end."""
    entry, adapter = state.models.find(name)
    if adapter is not None:   # it had been told the server was started with it
        raise bad_request(f"'{job.model}' is a LoRA adapter of {entry.name}: unload {entry.name} (its adapters "
                          "go with it), or drop the adapter with POST /v1/unload_lora_adapter.", "keep_alive",
                          "invalid_value")
    if entry.load is None:
        raise bad_request(f"'{job.model}' stays loaded: this server was started with it. Serve models with "
                          "`ruvllm serve A B ...` to have them loaded and unloaded on demand.", "keep_alive",
                          "invalid_value")
    state.models.unload_when_idle(entry)
    head: dict[str, Any] = {"model": job.model, "created_at": timestamp()}
    head.update({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})
    return {**head, "done": True, "done_reason": "unload"}


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
    """A model's details, chat template, architecture figures and capabilities: from the
    loaded engine, else from its files (nothing is loaded for it, as on Ollama: a client
    that shows every model must not churn the pool); loaded only where no file says."""
    state = get_state(request.app)
    state.require_ready()
    name = state.models.served_name(parse_show(await read_json(request, state.config.max_body_size)))
    entry, adapter = state.models.find(name)
    parent = entry.name if adapter else ""
    facts = entry_facts(state, entry)
    if facts is None:
        async with state.model_for(name) as model:
            facts = served_facts(model.served)
    capabilities = ["completion", *(["tools"] if facts.tools else []), *(["thinking"] if facts.thinking else [])]
    return json_response({"modelfile": "", "parameters": parameters(facts.sampling), "template": facts.template or "",
                          "details": details(facts, parent), "model_info": architecture_info(facts),
                          "capabilities": capabilities, "modified_at": timestamp(state.wall_started)})


def parameters(sampling: dict[str, float | int]) -> str:
    """A model's sampling defaults as Ollama's `parameters` text (its Modelfile's
    PARAMETER lines, name padded to 30): what a request's unset options take."""
    names = {"repetition_penalty": "repeat_penalty"}
    return "".join(f"{names.get(name, name):<30} {value:g}\n" for name, value in sampling.items())


def tagged(name: str) -> str:
    """Ollama's names always carry a tag (`:latest` by default); clients check for it."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def model_object(state: ServerState, entry: ModelEntry, name: str) -> dict[str, Any]:
    facts = entry_facts(state, entry)
    model = {"name": tagged(name), "model": tagged(name), "modified_at": timestamp(state.wall_started)}
    if name == entry.name and entry.path is not None:   # an adapter's files are not the entry's
        size, digest = files_digest(entry.path)
        model.update(size=size, digest=digest)
    return {**model, "details": details(facts, parent=entry.name if name != entry.name else "")}


def files_digest(path: Path) -> tuple[int, str]:
    """A model's bytes on disk and a digest of its files, as Ollama's `size` and `digest`
    (clients show the digest's first 12 characters as the model's ID). Ollama's digest
    is its manifest's sha256; ours hashes each file's name, size and, in the hub's
    cache, the blob it links to (an LFS blob is named by its content's sha256): it
    changes when the files do, and costs a stat a file, not a read."""
    import hashlib

    # Hidden entries (the quantized-weight cache a load writes beside a local model,
    # .cache/ of a hub download to a folder) are not the model's files.
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(path).parts)) if path.is_dir() else [path]
    digest, total = hashlib.sha256(), 0
    for file in files:
        try:
            size = file.stat().st_size
            target = os.readlink(file) if file.is_symlink() else ""
        except OSError:
            continue
        total += size
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}\0{size}\0{target}\n".encode())
    return total, digest.hexdigest()


@dataclass(frozen=True)
class Facts:
    """What Ollama's model routes say of a model, from its engine or its files."""

    config: dict[str, Any]            # config.json's
    template: str | None
    format: str                       # safetensors or gguf
    quantization: str                 # "" where the model is not loaded (the load decides)
    context: int | None               # the context it is served with (None: not loaded)
    tools: bool                       # its tool-call format is known
    thinking: bool                    # it reasons (markers in its template)
    sampling: dict[str, float | int]  # what unset sampling options take (generation_config.json's)


def entry_facts(state: ServerState, entry: ModelEntry) -> Facts | None:
    """From its engine where it is loaded, else from its files (None: neither tells)."""
    return served_facts(entry.served) if entry.served is not None else file_facts(entry.path, state)


def served_facts(served: Any) -> Facts:
    engine = served.client.engine
    config = engine.loaded.model.config
    quantization = getattr(getattr(engine, "config", None), "quantization", None)
    template = getattr(engine.tokenizer, "chat_template", None)
    path = str(getattr(config, "_name_or_path", "") or "")
    return Facts(config.to_dict(), template if isinstance(template, str) else None,
                 "gguf" if path.endswith(".gguf") else "safetensors", getattr(quantization, "value", "") or "",
                 engine.max_model_len, served.tool_parser is not None, served.reasoning is not None,
                 served.sampling_defaults)


def file_facts(path: Path | None, state: ServerState) -> Facts | None:
    """A model directory's config.json and chat template, read as the server's parsers
    would (None where there is no such directory: a GGUF file, or no path known)."""
    import json

    from ruvllm_cli.engine.reasoning import detect_format
    from ruvllm_cli.engine.sampling import model_sampling_defaults
    from ruvllm_cli.engine.tool_parsers import detect_parser

    if path is None or not (path / "config.json").is_file():
        return None
    try:
        config = json.loads((path / "config.json").read_text())
        template = _template_file(path)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    architecture = (config.get("architectures") or [None])[0]
    tools = state.config.tool_call_parser is not None or detect_parser(template, architecture) is not None
    thinking = state.config.reasoning_parser != "none" and detect_format(template) is not None
    sampling = model_sampling_defaults(path) if state.config.model_sampling else {}
    return Facts(config, template, "safetensors", "", None, tools, thinking, sampling)


def _template_file(path: Path) -> str | None:
    """The chat template as transformers reads it: chat_template.jinja, else tokenizer_config.json's."""
    import json

    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if not (path / "tokenizer_config.json").is_file():
        return None
    template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
    if isinstance(template, list):   # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def details(facts: Facts | None, parent: str = "") -> dict[str, Any]:
    """What Ollama says of a model's kind (empty where nothing is known of it)."""
    result: dict[str, Any] = {"parent_model": parent, "format": "", "family": "", "families": None,
                              "parameter_size": "", "quantization_level": ""}
    if facts is None:
        return result
    family = str(facts.config.get("model_type") or "")
    result.update(format=facts.format, family=family, families=[family] if family else None,
                  parameter_size=parameter_size(facts.config), quantization_level=facts.quantization)
    return result


def parameter_size(config: dict[str, Any]) -> str:
    """"494.0M", "7.6B": the parameters of the model's shape."""
    from ruvllm_cli.errors import ModelLoadError
    from ruvllm_cli.registry.model_config import count_parameters, shape_from_dict

    try:
        count = count_parameters(shape_from_dict(config))
    except (ModelLoadError, AttributeError, TypeError, ValueError):
        return ""
    return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def architecture_info(facts: Facts) -> dict[str, Any]:
    """Ollama's `model_info` keys for what a config says (GGUF's metadata names); the
    context length is the served one once loaded, the model's own before."""
    config = facts.config
    arch = str(config.get("model_type") or "unknown")
    info: dict[str, Any] = {"general.architecture": arch}
    context = facts.context if facts.context is not None else config.get("max_position_embeddings")
    for key, value in (("context_length", context), ("embedding_length", config.get("hidden_size")),
                       ("block_count", config.get("num_hidden_layers")),
                       ("feed_forward_length", config.get("intermediate_size")),
                       ("attention.head_count", config.get("num_attention_heads")),
                       ("attention.head_count_kv", config.get("num_key_value_heads")),
                       ("vocab_size", config.get("vocab_size"))):
        if value is not None:
            info[f"{arch}.{key}"] = value
    return info


def memory_bytes(engine: Any) -> int | None:
    """The model's weights and KV cache in memory (None where the engine runs elsewhere)."""
    weights = getattr(engine.loaded, "weight_bytes", None)
    kv = getattr(engine, "kv_cache_bytes", None)   # an engine in this process
    return None if weights is None or kv is None else weights + kv

