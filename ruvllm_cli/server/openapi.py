"""The server's OpenAPI 3.1 document (GET /openapi.json), built from the app's own
router and from the request field specs the handlers validate with
(protocol.REQUEST_FIELDS, messages_api.protocol's for /v1/messages and
responses_api.protocol's for /v1/responses): a route or
a field is in the document exactly when the server has it. The chat page's files
(web.PAGE_PATHS) are left out: a browser loads them, no program calls them. The
response schemas are checked against real answers by the fuzz test
(tests/server/test_fuzz_openapi.py)."""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Sequence

from aiohttp import web

from ruvllm_cli import __version__
from ruvllm_cli.server.errors import ERROR_TYPES
from ruvllm_cli.server.messages_api import errors as anthropic_errors, protocol as messages_protocol
from ruvllm_cli.server.messages_api.blocks import TEXT_BLOCK, THINKING_BLOCK, TOOL_USE_BLOCK
from ruvllm_cli.server.messages_api.responses import STOP_REASONS
from ruvllm_cli.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ruvllm_cli.server.middlewares import PUBLIC_PATHS
from ruvllm_cli.server.ollama_api import protocol as ollama_protocol
from ruvllm_cli.server.protocol import REQUEST_FIELDS
from ruvllm_cli.server.responses_api import protocol as responses_protocol
from ruvllm_cli.server.responses_api.output import RESPONSE_SCHEMA
from ruvllm_cli.server import tokens
from ruvllm_cli.server.spec import Field, JsonSchema, object_schema
from ruvllm_cli.server.web import PAGE_PATHS

_NULL_STRING = {"type": ["string", "null"]}
_LOGPROBS = {"type": ["object", "null"]}
_FINISH = {"enum": ["stop", "length", "tool_calls", None]}
_HEAD = {"id": {"type": "string"}, "created": {"type": "integer"}, "model": {"type": "string"},
         "system_fingerprint": {"type": "null"}}

# One server-sent event of a stream (stream: true): a chunk's JSON, or an error
# body, and `[DONE]` last; on /v1/messages Anthropic's named events, on /v1/responses
# OpenAI's (response.created to response.completed).
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
# Every JSON route's fields; a ChainMap reads the dicts live (a test may add a field).
ROUTE_FIELDS = ChainMap(REQUEST_FIELDS, messages_protocol.REQUEST_FIELDS, responses_protocol.REQUEST_FIELDS,
                        ollama_protocol.REQUEST_FIELDS, tokens.REQUEST_FIELDS)
_ANTHROPIC_ERROR_TYPES = sorted({*anthropic_errors.ERROR_TYPES.values(), "invalid_request_error", "api_error"})
_COUNT = {"type": "integer", "minimum": 0}
SCHEMAS: dict[str, JsonSchema] = {
    "Error": {"type": "object", "required": ["error"], "additionalProperties": False, "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"enum": sorted(set(ERROR_TYPES.values()))},
                       "param": _NULL_STRING, "code": _NULL_STRING}}}},
    "Usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        "completion_tokens_details": {"type": "object", "description": "A reasoning model's replies only.",
                                      "properties": {"reasoning_tokens": _COUNT}}}},
    "ChatCompletion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                       "properties": {**_HEAD, "object": {"const": "chat.completion"}, "choices": {
                           "type": "array", "items": {
                               "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
                                   "index": {"type": "integer"}, "logprobs": _LOGPROBS, "finish_reason": _FINISH,
                                   "message": {"type": "object", "required": ["role", "content"], "properties": {
                                       "role": {"const": "assistant"}, "content": _NULL_STRING,
                                       "refusal": {"type": "null"}, "tool_calls": {"type": "array"},
                                       "reasoning": {**_NULL_STRING, "description": "A reasoning model's "
                                                     "reasoning (absent for other models)."},
                                       "reasoning_content": _NULL_STRING}}}}},
                           "usage": {"$ref": "#/components/schemas/Usage"}}},
    "Completion": {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
                   "properties": {**_HEAD, "object": {"const": "text_completion"}, "choices": {
                       "type": "array", "items": {
                           "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
                               "index": {"type": "integer"}, "text": {"type": "string"}, "logprobs": _LOGPROBS,
                               "finish_reason": _FINISH}}},
                       "usage": {"$ref": "#/components/schemas/Usage"}}},
    "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}}},
    "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
        "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}, "max_model_len": {"type": ["integer", "null"]},
        "parent": {"type": ["string", "null"]}, "root": {"type": "string"},
        "status": {"enum": ["loaded", "loading", "unloading", "unloaded", "failed"]},
        "max_tokens_default": {"type": "object", "additionalProperties": {"type": "integer"}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "additionalProperties": False,
                       "properties": {"type": {"const": "error"}, "error": {
                           "type": "object", "required": ["type", "message"], "additionalProperties": False,
                           "properties": {"type": {"enum": _ANTHROPIC_ERROR_TYPES},
                                          "message": {"type": "string"}}}}},
    "Message": {"type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason",
                                               "stop_sequence", "usage"], "properties": {
        "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
        "model": {"type": "string"}, "content": {"type": "array", "items": {"anyOf": [THINKING_BLOCK, TEXT_BLOCK, TOOL_USE_BLOCK]}},
        "stop_reason": {"enum": list(STOP_REASONS)}, "stop_sequence": _NULL_STRING,
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens"], "properties": {
            "input_tokens": _COUNT, "output_tokens": _COUNT, "cache_read_input_tokens": _COUNT,
            "cache_creation_input_tokens": _COUNT}}}},
    "Response": RESPONSE_SCHEMA,
    "Tokens": {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"], "properties": {
        "count": _COUNT, "max_model_len": _COUNT, "tokens": {"type": "array", "items": _COUNT},
        "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}}},
    "Detokenized": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    "TokenCount": {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": _COUNT}},
    "OllamaError": {"type": "object", "required": ["error"], "additionalProperties": False,
                    "properties": {"error": {"type": "string"}}},
    "OllamaReply": {"type": "object", "required": ["model", "created_at", "done"], "properties": {
        "model": {"type": "string"}, "created_at": {"type": "string"}, "done": {"type": "boolean"},
        "done_reason": {"enum": ["stop", "length", "load", "unload", None]},
        "message": {"type": "object", "required": ["role", "content"], "properties": {
            "role": {"const": "assistant"}, "content": {"type": "string"}, "thinking": {"type": "string"},
            "tool_calls": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
                "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                    "name": {"type": "string"}, "arguments": {"type": "object"}}}}}}}},
        "response": {"type": "string"}, "thinking": {"type": "string"},
        **{name: _COUNT for name in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
                                     "eval_count", "eval_duration")}}},
    "OllamaModels": {"type": "object", "required": ["models"], "properties": {"models": {"type": "array", "items": {
        "type": "object", "required": ["name", "model", "details"], "properties": {
            "name": {"type": "string"}, "model": {"type": "string"}, "modified_at": {"type": "string"},
            "details": {"type": "object"}, "size": _COUNT, "size_vram": _COUNT, "expires_at": {"type": "string"},
            "context_length": _COUNT}}}}},
    "Health": {"type": "object", "required": ["status"], "properties": {
        "status": {"enum": ["ok", "loading", "engine_failed", "shutting_down"]}, "model": {"type": "string"},
        "models": {"type": "object", "additionalProperties": {"type": "string"}},
        "uptime_s": {"type": "number"}}},
}


@dataclass(frozen=True)
class Operation:
    """What the document says of one route beyond what the router knows."""

    summary: str
    answer: str | None = None                # the 200 body's schema; None: `content` below
    content: str = "application/json"
    errors: tuple[int, ...] = ()             # statuses answered with an Error body
    same_body: tuple[int, ...] = ()          # statuses answered with the 200's body
    streams: bool = False                    # `stream: true` answers in server-sent events (or stream_content)
    error_schema: str = "Error"              # the errors' shape: OpenAI's, AnthropicError or OllamaError
    stream_content: str = "text/event-stream"
    path_parameters: tuple[str, ...] = ()    # the `{name}` parts of the path, strings


_GENERATION_ERRORS = (400, 404, 408, 413, 429, 503)
OPERATIONS: dict[tuple[str, str], Operation] = {
    ("GET", "/health"): Operation("200 once the model is loaded (with several models, at once: `models` gives "
                                  "each one's status); 503 while loading or shutting down.", "Health",
                                  same_body=(503,)),
    ("GET", "/ping"): Operation("/health under vLLM's (and SageMaker's) name.", "Health", same_body=(503,)),
    ("POST", "/ping"): Operation("/health under vLLM's (and SageMaker's) name.", "Health", same_body=(503,)),
    ("GET", "/version"): Operation("The server's version (vLLM's route)."),
    ("GET", "/metrics"): Operation("Prometheus metrics.", content=METRICS_CONTENT_TYPE, errors=(503,)),
    ("GET", "/openapi.json"): Operation("This document.", content="application/json"),
    ("GET", "/v1/models"): Operation("The names this server answers to, with each model's `status` (a model "
                                     "loads on first use); a LoRA adapter's `parent` is its base model.",
                                     "ModelList", errors=(503,)),
    ("GET", "/v1/models/{model}"): Operation("One model by the name /v1/models lists; 404 for any other.", "Model",
                                             errors=(404, 503), path_parameters=("model",)),
    ("POST", "/v1/chat/completions"): Operation("A chat reply.", "ChatCompletion",
                                                errors=_GENERATION_ERRORS, streams=True),
    ("POST", "/v1/completions"): Operation("A completion of a prompt.", "Completion",
                                           errors=_GENERATION_ERRORS, streams=True),
    ("POST", "/v1/messages"): Operation("A reply in Anthropic's Messages API, with Anthropic's errors and "
                                        "stream events.", "Message", errors=_GENERATION_ERRORS, streams=True,
                                        error_schema="AnthropicError"),
    ("POST", "/v1/responses"): Operation("A reply in OpenAI's Responses API, stateless (nothing is stored), with "
                                         "its stream events.", "Response", errors=_GENERATION_ERRORS, streams=True),
    ("POST", "/v1/load_lora_adapter"): Operation(
        "Serve a LoRA adapter under a new model name (with --allow-runtime-lora).", content="text/plain",
        errors=(400, 404, 408, 413, 503)),
    ("POST", "/v1/unload_lora_adapter"): Operation(
        "Stop serving a LoRA adapter; 409 while requests use it (with --allow-runtime-lora).",
        content="text/plain", errors=(400, 404, 408, 409, 413, 503)),
    ("POST", "/tokenize"): Operation("vLLM's: a prompt's or a conversation's token ids, as a generation request "
                                     "would read them, with their count and the context.", "Tokens",
                                     errors=(400, 404, 408, 413, 503)),
    ("POST", "/detokenize"): Operation("vLLM's: token ids back to text.", "Detokenized",
                                       errors=(400, 404, 408, 413, 503)),
    ("POST", "/v1/messages/count_tokens"): Operation("Anthropic's: the input tokens of a Messages request.",
                                                     "TokenCount", errors=(400, 404, 408, 413, 503),
                                                     error_schema="AnthropicError"),
    ("GET", "/api/version"): Operation("Ollama's API: this server's version.", error_schema="OllamaError"),
    ("GET", "/api/tags"): Operation("Ollama's API: the models served, loaded or not.", "OllamaModels",
                                    errors=(503,), error_schema="OllamaError"),
    ("GET", "/api/ps"): Operation("Ollama's API: the models loaded now.", "OllamaModels", errors=(503,),
                                  error_schema="OllamaError"),
    ("POST", "/api/show"): Operation("Ollama's API: a model's details, template and capabilities (it is loaded "
                                     "for them).", errors=(400, 404, 408, 413, 503), error_schema="OllamaError"),
    ("POST", "/api/chat"): Operation("Ollama's chat API; streamed (its default) as one JSON object a line.",
                                     "OllamaReply", errors=_GENERATION_ERRORS, streams=True,
                                     error_schema="OllamaError", stream_content="application/x-ndjson"),
    ("POST", "/api/generate"): Operation("Ollama's generate API; streamed (its default) as one JSON object a line.",
                                         "OllamaReply", errors=_GENERATION_ERRORS, streams=True,
                                         error_schema="OllamaError", stream_content="application/x-ndjson"),
}


def openapi_document(app: web.Application, *, api_key: bool = False) -> JsonSchema:
    """The document of every API route `app` serves (HEAD and the chat page aside)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None or route.resource.canonical in PAGE_PATHS:
            continue
        key = (route.method, route.resource.canonical)
        if key not in OPERATIONS:
            raise KeyError(f"{key[0]} {key[1]} has no entry in openapi.OPERATIONS")
        guarded = api_key and key[1] not in PUBLIC_PATHS
        operation = operation_object(OPERATIONS[key], guarded, ROUTE_FIELDS.get(key[1], ()))
        paths.setdefault(key[1], {})[key[0].lower()] = operation
    document: JsonSchema = {
        "openapi": "3.1.0",
        "info": {"title": "ruvllm", "version": __version__,
                 "description": "An OpenAI-compatible API (the Responses API at /v1/responses, stateless), "
                                "Anthropic's Messages API at /v1/messages and Ollama's at /api/. Every "
                                "error body is {\"error\": {message, type, param, code}}, but on /v1/messages "
                                "Anthropic's {\"type\": \"error\", \"error\": {type, message}} and under /api/ "
                                "Ollama's {\"error\": message}; a request field that is null counts as absent."},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": SCHEMAS},
    }
    if api_key:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return document


def operation_object(operation: Operation, guarded: bool, request: Sequence[Field]) -> JsonSchema:
    """One operation, with `request` its JSON body's fields; `guarded`: it needs the API key."""
    ok: JsonSchema = {"schema": {"$ref": f"#/components/schemas/{operation.answer}"}} if operation.answer \
        else {"schema": {"type": "object"} if operation.content == "application/json" else {"type": "string"}}
    content = {operation.content: ok}
    if operation.streams:
        content[operation.stream_content] = {"schema": _EVENT if operation.stream_content == "text/event-stream"
                                             else {"type": "string"}}
    errors = (*operation.errors, *((401,) if guarded else ()))
    responses: JsonSchema = {"200": {"description": "OK", "content": content}}
    for status in operation.same_body:
        responses[str(status)] = {"description": "Not ready", "content": {operation.content: ok}}
    for status in sorted(errors):
        responses[str(status)] = _error_response(operation.error_schema)
    responses["default"] = _error_response(operation.error_schema)
    result: JsonSchema = {"summary": operation.summary, "responses": responses}
    if operation.path_parameters:
        result["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                for name in operation.path_parameters]
    if request:
        result["requestBody"] = {"required": True, "content": {"application/json": {"schema": object_schema(request)}}}
    if guarded:
        result["security"] = [{"bearer": []}, {"apiKey": []}]   # either one
    return result


def _error_response(schema: str) -> JsonSchema:
    shape = {"AnthropicError": "Anthropic's", "OllamaError": "Ollama's"}.get(schema, "OpenAI's")
    return {"description": f"An error in {shape} shape.",
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}
