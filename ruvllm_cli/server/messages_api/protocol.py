"""The body of POST /v1/messages, read through the same Field specs as the OpenAI
routes (so /openapi.json documents it) into the chat route's pieces. Every
malformed field is a 400 naming its param; fields we do not know are ignored, as
on the OpenAI routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ruvllm_cli.engine.request import RequestOptions
from ruvllm_cli.engine.tools import TOOL_NAME, Tool, ToolChoice, ToolRequest
from ruvllm_cli.errors import UsageError
from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import Fields, invalid_type, invalid_value, string_list
from ruvllm_cli.server.messages_api.blocks import MESSAGES_SCHEMA, SYSTEM_SCHEMA, parse_messages, parse_system
from ruvllm_cli.server.protocol import MODEL, MODEL_DEFAULT, SAMPLING, SERVING, SamplingFields
from ruvllm_cli.server.spec import Field, read_fields
from ruvllm_cli.server.structured import Structured, grammar_spec
from ruvllm_cli.server.tool_fields import MAX_TOOLS, check_object_schema, tool_request

PATH = "/v1/messages"
# Anthropic documents no cap; the engine searches the new text for each one per step.
MAX_STOP_SEQUENCES = 16
# Anthropic's tool_choice types, as the engine's ToolChoice modes.
CHOICE_MODES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


@dataclass(frozen=True)
class MessagesRequest:
    model: str
    messages: list[dict[str, Any]]   # for the chat template: the system prompt first, if any
    sampling: SamplingFields
    stream: bool = False
    tools: ToolRequest | None = None
    options: RequestOptions = RequestOptions()   # metadata.user_id as `user`, cache_salt, priority
    thinking: bool = False                       # a reasoning model's reasoning as thinking blocks


def parse_messages_request(body: Any) -> MessagesRequest:
    values = read_fields(Fields(body), REQUEST_FIELDS[PATH])
    sampling = SamplingFields(
        max_tokens=values["max_tokens"], stop=values["stop_sequences"], temperature=values["temperature"],
        top_p=values["top_p"], top_k=0 if values["top_k"] == -1 else values["top_k"], seed=values["seed"],
        ignore_eos=values["ignore_eos"], logit_bias=values["logit_bias"] or (), structured=values["output_config"],
        thinking_budget=_thinking_budget(values["thinking"]))
    tools = tool_request_of(values)
    if tools is not None and tools.choice.forced and sampling.structured is not None:
        raise bad_request("'tool_choice' and 'output_config.format' both constrain the reply; give one.",
                          "tool_choice", "invalid_value")
    metadata = values["metadata"] or {}
    options = RequestOptions(cache_salt=values["cache_salt"] or None, priority=values["priority"],
                             user=metadata.get("user_id") or None, session_id=values["session_id"] or None)
    thinking = values["thinking"]
    return MessagesRequest(values["model"], conversation_of(values), sampling, values["stream"],
                           tools, options, thinking is not None and thinking.get("type") != "disabled")


def conversation_of(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages for the chat template: Anthropic's top-level `system` first, as a
    system message; count_tokens renders the same."""
    system = values["system"]
    return [*([{"role": "system", "content": system}] if system else []), *values["messages"]]


def _thinking_budget(thinking: dict[str, Any] | None) -> int | None:
    """`budget_tokens` of enabled thinking: a reasoning model's reasoning ends there."""
    if thinking is None or thinking.get("type") != "enabled":
        return None
    return thinking.get("budget_tokens")


def tool_request_of(values: dict[str, Any]) -> ToolRequest | None:
    """The engine's ToolRequest from read `tools` and `tool_choice`, its errors in
    Anthropic's words (`any`, not `required`); count_tokens reads the same."""
    tools, (choice, parallel) = values["tools"], values["tool_choice"]
    if choice.forced and not tools:
        kind = next(k for k, mode in CHOICE_MODES.items() if mode == choice.mode)
        raise bad_request(f"'tool_choice' of type '{kind}' needs 'tools'.", "tool_choice", "invalid_value")
    if choice.name is not None and choice.name not in {tool.name for tool in tools}:
        raise invalid_value("tool_choice.name", "must be the name of one of the tools", choice.name)
    return tool_request({"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel})


# ---- the fields ------------------------------------------------------------------------
def _stop_sequences(value: list[Any]) -> tuple[str, ...]:
    return string_list(value, "stop_sequences", MAX_STOP_SEQUENCES)


def _tools(value: list[Any]) -> list[Tool]:
    if len(value) > MAX_TOOLS:
        raise invalid_value("tools", f"at most {MAX_TOOLS} tools", f"{len(value)} tools")
    return [_tool(item, f"tools[{i}]") for i, item in enumerate(value)]


def _tool(item: Any, where: str) -> Tool:
    """A client tool: name, description, input_schema. Anthropic's server tools
    (web search, bash, ...) run on Anthropic's side, so they are refused here."""
    if not isinstance(item, dict):
        raise invalid_type(where, "an object", item)
    if item.get("type") not in (None, "custom"):
        raise invalid_value(f"{where}.type", "only custom tools (name, description, input_schema) are supported",
                            item.get("type"))
    fields = Fields(item, f"{where}.")
    name = fields.string("name", required=True) or ""
    schema = fields.object("input_schema")
    if schema is None:
        raise bad_request(f"Missing required parameter: '{where}.input_schema'.", f"{where}.input_schema",
                          "missing_required_parameter")
    check_object_schema(schema.body, f"{where}.input_schema")
    strict = fields.raw("strict")   # Anthropic's structured outputs: the input follows the schema
    if strict is not None and not isinstance(strict, bool):
        raise invalid_type(f"{where}.strict", "a boolean", strict)
    try:
        return Tool(name, schema.body, fields.string("description"), strict=bool(strict))
    except UsageError as error:
        raise invalid_value(f"{where}.name", error.message, name) from error


def _tool_choice(choice: Fields) -> tuple[ToolChoice, bool]:
    """(the engine's ToolChoice, whether one reply may hold several calls)."""
    kind = choice.body["type"]
    name = choice.string("name")
    if kind == "tool" and not name:
        raise bad_request("Missing required parameter: 'tool_choice.name'.", "tool_choice.name",
                          "missing_required_parameter")
    return ToolChoice(CHOICE_MODES[kind], name if kind == "tool" else None), not choice.boolean(
        "disable_parallel_tool_use")


def _output_config(config: Fields) -> Structured | None:
    """Anthropic's structured output: `format` a JSON schema the reply's text must
    follow, enforced as `response_format` is on the chat route. `effort` has no
    meaning for these models and is let through."""
    output_format = config.object("format")
    if output_format is None:
        return None
    kind = output_format.string("type", required=True)
    if kind != "json_schema":
        raise invalid_value("output_config.format.type", "must be json_schema", kind)
    schema = output_format.object("schema")
    if schema is None:
        raise bad_request("Missing required parameter: 'output_config.format.schema'.",
                          "output_config.format.schema", "missing_required_parameter")
    return Structured(grammar_spec("json_schema", schema.body, "output_config.format.schema"), "output_config.format")


_TOOL = {"type": "object", "required": ["name", "input_schema"], "properties": {
    "type": {"enum": ["custom", None]}, "name": {"type": "string", "pattern": TOOL_NAME.pattern},
    "description": {"type": ["string", "null"]},
    "input_schema": {"type": "object", "description": "A JSON schema of the tool's input."}}}
_STOP = {"type": "array", "maxItems": MAX_STOP_SEQUENCES, "items": {"type": "string"}}
_SHARED = {spec.name: spec for spec in (*SAMPLING, *SERVING)}

MESSAGES_FIELDS = (
    MODEL,
    Field("max_tokens", "integer", "Most tokens to generate.", required=True, low=1),
    Field("messages", "array", "The conversation: text, tool_use and tool_result blocks.", required=True,
          parse=parse_messages, schema=MESSAGES_SCHEMA),
    Field("system", None, "The system prompt, put through the chat template.", "", parse=parse_system,
          schema=SYSTEM_SCHEMA),
    Field("stop_sequences", "array", "Text that ends the reply (not included; echoed as stop_sequence).", (),
          parse=_stop_sequences, schema=_STOP),
    Field("temperature", "number", "0: greedy; 1 (Anthropic's highest): plain sampling "
                                   f"({MODEL_DEFAULT} 1).", low=0.0, high=1.0),
    _SHARED["top_p"], _SHARED["top_k"],
    Field("stream", "boolean", "Send the reply as Anthropic's server-sent events, message_start to "
                               "message_stop.", False),
    Field("tools", "array", "Tools the model may call.", (), parse=_tools,
          schema={"type": "array", "maxItems": MAX_TOOLS, "items": _TOOL}),
    Field("tool_choice", "object", "Whether and which tool the model must call.", (ToolChoice(), True),
          parse=_tool_choice, properties=(
              Field("type", "string", required=True, enum=tuple(CHOICE_MODES)),
              Field("name", "string", "The tool, with type tool."),
              Field("disable_parallel_tool_use", "boolean", "At most one call in the reply.", False))),
    Field("thinking", "object", "Extended thinking: with type enabled, a reasoning model's reasoning comes back "
          "as thinking blocks (without it the reply holds its answer alone).", properties=(
              Field("type", "string", required=True, enum=("enabled", "disabled", "adaptive")),
              Field("budget_tokens", "integer", "At most this many tokens of reasoning: then the model's end "
                                                "marker is forced and it answers.", low=1))),
    Field("metadata", "object", properties=(
        Field("user_id", "string", "Who the request is for: kept with the request, logged."),)),
    Field("output_config", "object", "Structured output: the reply's text follows `format`'s JSON schema.",
          parse=_output_config, properties=(
              Field("format", "object", "{type: json_schema, schema}: the JSON schema of the reply's text."),
              Field("effort", "string", "Accepted and ignored (no reasoning effort to set here)."))),
    # ruvllm's and vLLM's extensions, which Anthropic's SDK sends through `extra_body`.
    _SHARED["seed"], _SHARED["ignore_eos"], _SHARED["logit_bias"], _SHARED["cache_salt"], _SHARED["priority"],
    _SHARED["session_id"],
)
REQUEST_FIELDS: dict[str, tuple[Field, ...]] = {PATH: MESSAGES_FIELDS}
