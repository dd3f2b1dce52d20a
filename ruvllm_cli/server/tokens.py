"""Counting tokens without generating: vLLM's POST /tokenize and /detokenize, and
Anthropic's POST /v1/messages/count_tokens (which Claude Code and Anthropic SDK apps
call to size their context). A prompt is tokenized as /v1/completions tokenizes it
and a conversation goes through the chat template as on the chat routes, so a count
here is the `prompt_tokens` (or `input_tokens`) the same request would be billed."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from aiohttp import web

from ruvllm_cli.engine.tools import ToolChoice
from ruvllm_cli.server.body import read_json
from ruvllm_cli.server.expect import expect_continue
from ruvllm_cli.server.errors import bad_request, json_response
from ruvllm_cli.server.fields import Fields, invalid_type, invalid_value
from ruvllm_cli.server.messages import MESSAGES
from ruvllm_cli.server.messages_api import protocol as messages_protocol
from ruvllm_cli.server.prompts import render_chat, template_tools, tokenize_prompts
from ruvllm_cli.server.protocol import MODEL, TEMPLATE_FIELDS, template_options
from ruvllm_cli.server.spec import Field, read_fields
from ruvllm_cli.server.state import ServerState, get_state
from ruvllm_cli.server.tool_fields import TOOL_FIELDS, tool_request

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
MAX_DETOKENIZE = 1 << 20   # token ids in one /detokenize body (a 4 MiB body holds fewer)


def add_token_routes(app: web.Application) -> None:
    app.router.add_post(TOKENIZE_PATH, tokenize, expect_handler=expect_continue)
    app.router.add_post(DETOKENIZE_PATH, detokenize, expect_handler=expect_continue)
    app.router.add_post(COUNT_TOKENS_PATH, count_tokens, expect_handler=expect_continue)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's: `prompt` as a completion reads it, or `messages` (with `tools` and the
    template fields) as a chat request renders them; the ids, their count, the context."""
    state = get_state(request.app)
    values = read_fields(Fields(await read_json(request, state.config.max_body_size)), TOKENIZE_FIELDS)
    if (values["prompt"] is None) == (values["messages"] is None):
        raise bad_request("Give 'prompt' or 'messages' (one of them).", "prompt", "invalid_value")
    tools = tool_request({"tools": values["tools"], "tool_choice": ToolChoice(), "parallel_tool_calls": True})
    template = template_options(values)
    async with state.model_for(values["model"]) as model:
        engine = model.engine

        def count() -> list[int]:
            if values["prompt"] is not None:
                return tokenize_prompts(engine.tokenizer, [values["prompt"]], engine.vocab_size)[0]
            messages = values["messages"]
            return render_chat(engine.tokenizer, messages, template_tools(tools, messages), "messages", template)

        ids = await _off_the_loop(state, count)
        strings = [model.token_texts.text(t) for t in ids] if values["return_token_strs"] else None
        return json_response({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                              "token_strs": strings})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's: token ids back to text, special tokens included."""
    state = get_state(request.app)
    values = read_fields(Fields(await read_json(request, state.config.max_body_size)), DETOKENIZE_FIELDS)
    async with state.model_for(values["model"]) as model:
        engine, ids = model.engine, values["tokens"]
        outside = next((t for t in ids if not 0 <= t < engine.vocab_size), None)
        if outside is not None:
            raise invalid_value("tokens", f"token ids within the vocabulary [0, {engine.vocab_size})", outside)
        text = await _off_the_loop(state, lambda: engine.tokenizer.decode(ids, skip_special_tokens=False))
        return json_response({"prompt": text})


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's: the input tokens a /v1/messages request of these fields would have."""
    state = get_state(request.app)
    values = read_fields(Fields(await read_json(request, state.config.max_body_size)), COUNT_TOKENS_FIELDS)
    messages = messages_protocol.conversation_of(values)
    tools = messages_protocol.tool_request_of(values)   # tool_choice none leaves the tools out, as there
    async with state.model_for(values["model"]) as model:
        tokenizer = model.engine.tokenizer
        ids = await _off_the_loop(state, lambda: render_chat(tokenizer, messages, template_tools(tools, messages)))
        return json_response({"input_tokens": len(ids)})


async def _off_the_loop(state: ServerState, work: Callable[[], Any]) -> Any:
    """Rendering a long conversation or decoding many ids must not stall other requests."""
    return await asyncio.get_running_loop().run_in_executor(state.executor, work)


def _token_ids(value: Any) -> list[int]:
    if len(value) > MAX_DETOKENIZE:
        raise invalid_value("tokens", f"at most {MAX_DETOKENIZE} token ids", f"{len(value)} ids")
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool):
            raise invalid_type(f"tokens[{i}]", "an integer (a token id)", token)
    return list(value)


TOKENIZE_FIELDS = (
    MODEL,
    Field("prompt", "string", "A prompt, tokenized as /v1/completions reads it."),
    Field("messages", MESSAGES.type, "A conversation, rendered by the chat template as on /v1/chat/completions.",
          parse=MESSAGES.parse, schema=MESSAGES.schema),
    TOOL_FIELDS[0], *TEMPLATE_FIELDS,
    Field("return_token_strs", "boolean", "Each token's text as well (`token_strs`).", False),
)
DETOKENIZE_FIELDS = (
    MODEL,
    Field("tokens", "array", "Token ids.", required=True, parse=_token_ids,
          schema={"type": "array", "maxItems": MAX_DETOKENIZE, "items": {"type": "integer"}}),
)
_ANTHROPIC = {spec.name: spec for spec in messages_protocol.MESSAGES_FIELDS}
COUNT_TOKENS_FIELDS = (MODEL, _ANTHROPIC["messages"], _ANTHROPIC["system"], _ANTHROPIC["tools"],
                       _ANTHROPIC["tool_choice"])
REQUEST_FIELDS: dict[str, tuple[Field, ...]] = {TOKENIZE_PATH: TOKENIZE_FIELDS, DETOKENIZE_PATH: DETOKENIZE_FIELDS,
                                               COUNT_TOKENS_PATH: COUNT_TOKENS_FIELDS}
