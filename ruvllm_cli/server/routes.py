"""Request handlers: /health, /metrics, /openapi.json, /v1/models[/{model}], /v1/chat/completions,
/v1/completions, and on the chat path Anthropic's /v1/messages and OpenAI's /v1/responses."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

from aiohttp import web

from ruvllm_cli import __version__

from ruvllm_cli.engine.loop import EngineFailedError
from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.reasoning import Reasoning
from ruvllm_cli.engine.request import FinishReason, RequestOptions
from ruvllm_cli.engine.tool_parsers import ToolParser
from ruvllm_cli.engine.tools import ToolRequest
from ruvllm_cli.server import adapters, bridge
from ruvllm_cli.server.body import read_json
from ruvllm_cli.server.expect import expect_continue
from ruvllm_cli.server.bridge import Choice
from ruvllm_cli.server.engine_client import EngineClient, EngineStream as RequestStream
from ruvllm_cli.server.errors import ApiError, bad_request, json_response
from ruvllm_cli.server.messages_api.protocol import parse_messages_request
from ruvllm_cli.server.messages_api.responses import MessagesFormat
from ruvllm_cli.server.middlewares import ARRIVED, CLIENT_GONE, internal_error, log_internal_error
from ruvllm_cli.server.metrics import CONTENT_TYPE, EngineSnapshot
from ruvllm_cli.server.ollama_api.routes import add_ollama_routes
from ruvllm_cli.server.openapi import openapi_document
from ruvllm_cli.server.prompts import (SequencePlan, check_constraints, plan_sequences, reasoning_sampling,
                                       render_chat, template_tools, tokenize_prompts, tool_sampling)
from ruvllm_cli.server.models import Lease
from ruvllm_cli.server.protocol import (COMPLETION_MAX_TOKENS, CompletionRequest, SamplingFields, TemplateOptions,
                                        parse_chat_request, parse_completion_request)
from ruvllm_cli.server.responses import ChatFormat, CompletionFormat, ResponseFormat, ResponseMeta
from ruvllm_cli.server.responses_api.events import ResponsesFormat
from ruvllm_cli.server.responses_api.output import ResponseHead
from ruvllm_cli.server.responses_api.protocol import parse_responses_request
from ruvllm_cli.server.sse import EventStream
from ruvllm_cli.server.state import ServerState, get_state
from ruvllm_cli.server.structured import Structured, mark_repaired, repair_spec, repair_truncated_json
from ruvllm_cli.server.tokens import add_token_routes
from ruvllm_cli.server.tool_output import ToolReplies

METRICS_TIMEOUT_S = 10.0
log = logging.getLogger("ruvllm.server")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)    # vLLM's (SageMaker's) name for it
    app.router.add_post("/ping", health, expect_handler=expect_continue)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)   # served names may hold "/"
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=expect_continue)
    app.router.add_post("/v1/completions", completions, expect_handler=expect_continue)
    app.router.add_post("/v1/messages", messages, expect_handler=expect_continue)
    app.router.add_post("/v1/responses", responses, expect_handler=expect_continue)
    app.router.add_post("/v1/load_lora_adapter", adapters.load_lora_adapter, expect_handler=expect_continue)
    app.router.add_post("/v1/unload_lora_adapter", adapters.unload_lora_adapter, expect_handler=expect_continue)
    add_ollama_routes(app)
    add_token_routes(app)


# ---- plain routes ------------------------------------------------------------------------
async def health(request: web.Request) -> web.Response:
    state = get_state(request.app)
    if state.draining:
        return json_response({"status": "shutting_down"}, status=503)
    if state.ready_at is None:
        return json_response({"status": "loading"}, status=503)
    models = {entry.name: entry.status.value for entry in state.models.entries}
    extra = state.models.health()   # the replicas' states behind --replicas
    if not state.models.healthy:
        return json_response({"status": "engine_failed", "models": models, **extra}, status=503)
    return json_response({"status": "ok", "model": state.model_name, "models": models,
                          "uptime_s": round(time.monotonic() - state.ready_at, 3), **extra})


async def version(request: web.Request) -> web.Response:
    """vLLM's `GET /version`: the server's version."""
    return json_response({"version": __version__})


async def openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document(request.app, api_key=bool(get_state(request.app).config.api_key)))


async def list_models(request: web.Request) -> web.Response:
    state = get_state(request.app)
    state.require_ready()
    return json_response({"object": "list", "data": model_objects(state)})


async def retrieve_model(request: web.Request) -> web.Response:
    """One model object by name (OpenAI's `models.retrieve`); the 404 of a request
    that names another."""
    state = get_state(request.app)
    state.require_ready()
    name = state.models.served_name(request.match_info["model"])   # `tiny:latest` is `tiny`'s (a 500 before)
    state.models.find(name)
    return json_response(next(model for model in model_objects(state) if model["id"] == name))


def model_objects(state: ServerState) -> list[dict[str, Any]]:
    created = int(time.time() - (time.monotonic() - state.started))
    # Beyond OpenAI's fields: what a client needs to size its requests.
    defaults = {"/v1/chat/completions": state.config.chat_max_tokens, "/v1/completions": COMPLETION_MAX_TOKENS,
                "/v1/responses": state.config.chat_max_tokens}
    data = []
    for entry in state.models.entries:
        # `status`: loaded, loading, unloading, unloaded or failed (a model loads on first use).
        common = {"object": "model", "created": created, "owned_by": "ruvllm", "status": entry.status.value,
                  "max_model_len": entry.served.client.engine.max_model_len if entry.served else None,
                  "max_tokens_default": defaults}
        # LoRA adapters are models of their own, with their base model as `parent` (vLLM's
        # field); `root` (vLLM's too): the model each name serves, one for a model's names.
        data += [{"id": name, **common, "root": entry.name, "parent": None} for name in entry.names]
        data += [{"id": name, **common, "root": entry.name, "parent": entry.name} for name in entry.adapter_names()]
    return data


async def metrics(request: web.Request) -> web.Response:
    """Engine figures are those of the loaded models, summed, with the counters of those
    unloaded before (the pool's own figures are per model)."""
    state = get_state(request.app)
    snapshots = []
    # The engines listed and those unloaded before, read together (an unload moves one
    # from the first to the second in one step), so each engine counts once.
    listed, retired = state.models.loaded(), state.models.retired
    with state.admission.scraping():   # a shutdown waits for it, as for a generation
        for served in listed:
            try:
                snapshots.append(await engine_snapshot(state, served.client))
            except EngineFailedError:   # unloaded meanwhile: its counts as it left (or dead: /health says so)
                if served.final_counts is not None:
                    snapshots.append(served.final_counts)
    # The unloaded engines' counters too (so no counter goes back), and the gauges at 0 with none loaded.
    body = state.metrics.render(EngineSnapshot.total([*snapshots, retired]))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def engine_snapshot(state: ServerState, engine_loop: EngineClient) -> EngineSnapshot:
    """The engine's figures, read on its thread between steps; a 503 once the shutdown
    timeout runs out or after METRICS_TIMEOUT_S."""
    aio = asyncio.get_running_loop()
    # The engine answers between steps (or replicas over the network): off the event loop.
    reading = aio.run_in_executor(state.executor, engine_loop.snapshot)
    expired = asyncio.ensure_future(state.expired.wait())
    try:
        await asyncio.wait({reading, expired}, timeout=METRICS_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        expired.cancel()
    if reading.done():
        return reading.result()
    if state.expired.is_set():
        raise bridge.shutting_down()
    raise ApiError(503, f"The engine did not answer within {METRICS_TIMEOUT_S:g} s.", code="engine_busy")


# ---- generation ------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = get_state(request.app)
    state.require_ready()
    chat = parse_chat_request(await read_json(request, state.config.max_body_size), state.limits)
    async with state.model_for(chat.model) as model:
        options = dataclasses.replace(chat.options, adapter=model.adapter)
        parser = model.require_tool_parser() if chat.tools and chat.tools.active else None
        sampling = dataclasses.replace(chat.sampling, default_max_tokens=state.config.chat_max_tokens
                                       ).with_defaults(model.sampling_defaults)
        prepare = chat_prepare(model.engine, chat.messages, chat.tools, parser, sampling, options,
                               template=chat.template, reasoning=model.reasoning)
        fmt = ChatFormat(ResponseMeta.new("chatcmpl", chat.model), model.token_texts, chat.sampling.logprobs,
                         chat.streaming.include_usage, ToolReplies.of(parser, chat.tools), chat.include_reasoning)
        return await generate(request, state, model, prepare, "messages", chat.sampling.n,
                              fmt, chat.streaming.stream, chat.sampling.structured, options)


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API: a chat request in another shape (server/messages_api)."""
    state = get_state(request.app)
    state.require_ready()
    job = parse_messages_request(await read_json(request, state.config.max_body_size))
    async with state.model_for(job.model) as model:
        options = dataclasses.replace(job.options, adapter=model.adapter)
        parser = model.require_tool_parser() if job.tools and job.tools.active else None
        sampling = job.sampling.with_defaults(model.sampling_defaults)
        prepare = chat_prepare(model.engine, job.messages, job.tools, parser, sampling, options,
                               reasoning=model.reasoning)
        fmt = MessagesFormat(job.model, ToolReplies.of(parser, job.tools), job.thinking)
        return await generate(request, state, model, prepare, "messages", 1, fmt, job.stream, job.sampling.structured,
                              options)


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API, stateless: a chat request in another shape (server/responses_api)."""
    state = get_state(request.app)
    state.require_ready()
    job = parse_responses_request(await read_json(request, state.config.max_body_size))
    async with state.model_for(job.model) as model:
        options = dataclasses.replace(job.options, adapter=model.adapter)
        parser = model.require_tool_parser() if job.tools and job.tools.active else None
        sampling = dataclasses.replace(job.sampling, default_max_tokens=state.config.chat_max_tokens
                                       ).with_defaults(model.sampling_defaults)
        prepare = chat_prepare(model.engine, job.messages, job.tools, parser, sampling, options, "input",
                               reasoning=model.reasoning)
        # The Response carries the values it was sampled with, as OpenAI's (1 where unset).
        echo = {**job.echo, "temperature": sampling.temperature, "top_p": sampling.top_p}
        fmt = ResponsesFormat(ResponseHead(job.model, echo), ToolReplies.of(parser, job.tools))
        return await generate(request, state, model, prepare, "input", 1, fmt, job.stream, sampling.structured,
                              options)


def chat_prepare(engine: Any, messages: list[dict[str, Any]], tools: ToolRequest | None, parser: ToolParser | None,
                 sampling: SamplingFields, options: RequestOptions, param: str = "messages",
                 template: TemplateOptions = TemplateOptions(), reasoning: Reasoning | None = None
                 ) -> Callable[[], list[SequencePlan]]:
    """The work before submitting a chat reply (in a worker thread): the tools' grammar,
    the constraints' checks, the prompt through the template, a reasoning model's
    markers, one plan per sequence. `param` is the field the conversation came in,
    for errors about it."""

    def prepare() -> list[SequencePlan]:
        plan_sampling = sampling
        if parser is not None:
            assert tools is not None
            plan_sampling = tool_sampling(engine.tokenizer, tools, parser, sampling)
        plan_sampling = check_constraints(engine, plan_sampling)
        prompt_ids = render_chat(engine.tokenizer, messages, template_tools(tools, messages), param, template)
        in_reasoning = False
        if reasoning is not None:
            continued = _text_of(messages[-1]) if template.continue_final_message else None
            plan_sampling, in_reasoning = reasoning_sampling(engine.tokenizer, reasoning, plan_sampling, prompt_ids,
                                                             continued)
        return plan_sequences([prompt_ids], plan_sampling, engine.max_model_len, param, options, reasoning,
                              in_reasoning)

    return prepare


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


async def completions(request: web.Request) -> web.StreamResponse:
    state = get_state(request.app)
    state.require_ready()
    job = parse_completion_request(await read_json(request, state.config.max_body_size), state.limits)
    async with state.model_for(job.model) as model:
        options = dataclasses.replace(job.options, adapter=model.adapter)
        job = dataclasses.replace(job, sampling=job.sampling.with_defaults(model.sampling_defaults))
        prepare, echo_texts = completion_prepare(model.engine, job, options)
        fmt = CompletionFormat(ResponseMeta.new("cmpl", job.model), model.token_texts, job.sampling.logprobs,
                               job.streaming.include_usage, echo_texts)
        return await generate(request, state, model, prepare, "prompt", len(job.prompts) * job.sampling.n,
                              fmt, job.streaming.stream, job.sampling.structured, options)


def completion_prepare(engine: Any, job: CompletionRequest, options: RequestOptions
                       ) -> tuple[Callable[[], list[SequencePlan]], list[str]]:
    """The work before submitting a completion (in a worker thread), and the echoed
    prompts' texts it fills in."""
    echo_texts: list[str] = []

    def prepare() -> list[SequencePlan]:
        sampling = check_constraints(engine, job.sampling)
        prompt_ids = tokenize_prompts(engine.tokenizer, job.prompts, engine.vocab_size)
        if job.echo:
            echo_texts.extend(p if isinstance(p, str) else engine.tokenizer.decode(ids)
                              for p, ids in zip(job.prompts, prompt_ids))
        return plan_sequences(prompt_ids, sampling, engine.max_model_len, "prompt", options)

    return prepare, echo_texts


async def generate(request: web.Request, state: ServerState, model: Lease,
                   prepare: Callable[[], list[SequencePlan]], param: str, num_sequences: int,
                   fmt: ResponseFormat, stream: bool, structured: Structured | None = None,
                   options: RequestOptions = RequestOptions(),
                   writer: type[EventStream] = EventStream) -> web.StreamResponse:
    """Admit, submit, then answer in one body or as a stream; the engine requests
    never outlive the handler (a client that leaves cancels them, and so does the
    end of the shutdown timeout: a 503, or on a stream the format's error ending)."""
    started = request.get(ARRIVED) or time.perf_counter()   # the body's upload and a model's load count
    if options.priority and getattr(model.client.engine.config, "scheduling_policy", None) == "fcfs":
        # vLLM's 400 too: a priority that changes nothing would only mislead
        raise bad_request(f"'priority' {options.priority} needs a server started with --scheduling-policy "
                          "priority; under fcfs requests go in arrival order.", "priority", "invalid_value")
    with state.admission.reserve(num_sequences):
        plans, streams = await bridge.submit(model.client, state.executor, prepare, param)
        choices = bridge.choices_for(plans)
        for choice in choices:   # counted as they come, as vLLM's counter: a long reply is not one late spike
            choice.on_tokens = state.metrics.generation_tokens.inc
        try:
            repair = repair_check(model, structured) if structured is not None and structured.repairable else None
            if stream:
                return await stream_response(request, streams, choices, fmt, state.expired, repair, writer)
            try:
                await bridge.collect(streams, choices, state.expired)
            except bridge.ShuttingDown:
                raise bridge.shutting_down() from None
            for choice in choices:
                bridge.check_finished(choice)
                if repair:
                    repair_truncated_json(choice, allowed=repair)
            return json_response(mark_repaired(fmt.body(choices), choices))
        finally:
            bridge.cancel_all(streams)
            record(state, started, choices, model.name, options, request.path)


RepairCheck = Callable[[str], bool]   # whether a json-repaired reply is one the request's grammar takes


def repair_check(model: Lease, structured: Structured) -> RepairCheck:
    """What a json-repair must pass: the request's schema with nothing required (a cut
    reply lacks what it had not reached; its values must still be of their types),
    compiled on the grammar pool while the reply is generated."""
    compiler = model.client.engine.grammar_compiler
    spec = repair_spec(structured.spec)
    compiler.submit(spec)
    return lambda text: compiler.accepts_text(spec, text)


async def stream_response(request: web.Request, streams: Sequence[RequestStream], choices: Sequence[Choice],
                          fmt: ResponseFormat, stop: asyncio.Event, repair: RepairCheck | None = None,
                          writer: type[EventStream] = EventStream) -> web.StreamResponse:
    """Every stream's outputs as SSE chunks; whatever ends it (all finished, an engine
    error, the shutdown timeout), the client gets a complete stream with the format's
    ending (OpenAI's [DONE], Anthropic's message_stop or error event)."""
    sse = writer(request)
    try:
        await sse.open()
        for choice in choices:
            for chunk in fmt.opening(choice):
                await sse.send(chunk)
        try:
            error = await send_outputs(sse, streams, choices, fmt, stop, repair)
        except bridge.ShuttingDown:
            error = bridge.shutting_down()
        except ApiError as failed:   # a replica behind --replicas died mid-stream: a 503 event
            error = failed
        except ConnectionResetError:
            raise   # the client left (a write reached its closing transport): a 499 below, not an error
        except Exception as failed:  # noqa: BLE001 - the stream has begun: an error event, not a 500
            # response written into its body (a client read "illegal chunk header")
            log_internal_error(request, failed, get_state(request.app).config.verbose)
            error = internal_error()
        for chunk in fmt.error_chunks(error) if error is not None else fmt.closing(choices):
            await sse.send(chunk)
        return await sse.close()
    except ConnectionResetError:
        request[CLIENT_GONE] = True   # counted as 499; the caller cancels the streams
        return sse.response


async def send_outputs(sse: EventStream, streams: Sequence[RequestStream], choices: Sequence[Choice],
                       fmt: ResponseFormat, stop: asyncio.Event, repair: RepairCheck | None) -> ApiError | None:
    """Chunks until every stream ends; the error that ended one early, if any."""
    events = bridge.merged(streams, stop)
    try:
        async for position, output in events:
            choice = choices[position]
            split = choice.add(output)
            if output.finished and choice.finish_reason in (FinishReason.CANCELLED, FinishReason.ERROR):
                return finish_error(choice)
            chunks = fmt.reasoning(choice, split.reasoning) if split.reasoning else []
            if split.content != output.text:
                output = dataclasses.replace(output, text=split.content)
            for chunk in [*chunks, *fmt.deltas(choice, output)]:
                await sse.send(chunk)
            if output.finished:
                await send_final(sse, fmt, choice, output, repair)
    finally:
        await events.aclose()
    return None


async def send_final(sse: EventStream, fmt: ResponseFormat, choice: Choice, output: RequestOutput,
                     repair: RepairCheck | None) -> None:
    suffix = repair_truncated_json(choice, streamed=True, allowed=repair) if repair else ""
    chunks = [*(fmt.deltas(choice, RequestOutput(output.request_id, [], suffix)) if suffix else []),
              *fmt.flush(choice)]
    final = fmt.final(choice)   # after flush, which settles the tool calls it reports
    for chunk in [*chunks, mark_repaired(final, [choice]) if repair else final]:
        await sse.send(chunk)


def finish_error(choice: Choice) -> ApiError:
    try:
        bridge.check_finished(choice)
    except ApiError as error:
        return error
    raise AssertionError("finish_error on a choice that finished normally")


def record(state: ServerState, started: float, choices: Sequence[Choice], model: str, options: RequestOptions,
           path: str) -> None:
    metrics = state.metrics
    for choice in choices:
        if choice.first_token_at is not None:
            metrics.ttft.observe(choice.first_token_at - started)
        if choice.queue_wait is not None:
            metrics.queue_time.observe(choice.queue_wait)
    first_copies = {c.prompt_index: c for c in reversed(choices)}
    metrics.prompt_tokens.inc(sum(c.num_prompt_tokens for c in first_copies.values()))
    elapsed = time.perf_counter() - started
    metrics.e2e_latency.observe(elapsed)
    log_request(path, model, options, choices, sum(c.num_prompt_tokens for c in first_copies.values()), elapsed)


def log_request(path: str, model: str, options: RequestOptions, choices: Sequence[Choice],
                prompt_tokens: int, elapsed: float) -> None:
    """One line per request at INFO (shown with --verbose): who, which model, how long it queued."""
    waits = [c.queue_wait for c in choices if c.queue_wait is not None]
    log.info("%s model=%s user=%s session=%s priority=%d sequences=%d prompt=%d output=%d queue=%s e2e=%.3fs",
             path, options.adapter or model, options.user or "-", options.session_id or "-",
             options.priority, len(choices), prompt_tokens, sum(c.num_output_tokens for c in choices),
             f"{max(waits):.3f}s" if waits else "-", elapsed)
