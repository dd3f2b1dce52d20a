"""The body of POST /v1/responses, read through the same Field specs as the chat
route (so /openapi.json documents it) into the chat route's pieces. Every malformed
field is a 400 naming its param; fields we do not know are ignored, as on the other
routes. Nothing is stored, so what needs an earlier response is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ruvllm_cli.engine.grammar import GrammarSpec
from ruvllm_cli.engine.request import RequestOptions
from ruvllm_cli.engine.tools import TOOL_NAME, Tool, ToolChoice, ToolRequest
from ruvllm_cli.errors import UsageError
from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import Fields, invalid_type, invalid_value
from ruvllm_cli.server.protocol import MODEL, SAMPLING, SERVING, SamplingFields
from ruvllm_cli.server.responses_api.items import INPUT_SCHEMA, parse_input
from ruvllm_cli.server.spec import Field, read_fields
from ruvllm_cli.server.structured import Structured, grammar_spec
from ruvllm_cli.server.tool_fields import MAX_TOOLS, check_object_schema, tool_request

PATH = "/v1/responses"
TOOL_CHOICES = ("auto", "none", "required")
FORMATS = ("text", "json_object", "json_schema")
MAX_METADATA = (16, 64, 512)   # OpenAI's caps: keys, a key's length, a value's length
STATELESS = "this server stores no responses (it is stateless): send the whole conversation as 'input'."
LOGPROBS = "message.output_text.logprobs"


@dataclass(frozen=True)
class FunctionTool:
    """A function tool in the Responses API's flat shape, echoed as it was applied:
    `strict` true unless the request said false, as OpenAI's (it had echoed a left-out
    `strict` as null, though the tool was held to its schema)."""

    tool: Tool

    def echo(self) -> dict[str, Any]:
        return {"type": "function", "name": self.tool.name, "description": self.tool.description,
                "parameters": self.tool.parameters, "strict": self.tool.strict}


@dataclass(frozen=True)
class TextFormat:
    """`text.format`: the chat route's structured output, and how the Response echoes it."""

    structured: Structured | None
    echo: dict[str, Any]


PLAIN_TEXT = TextFormat(None, {"type": "text"})


@dataclass(frozen=True)
class ResponsesRequest:
    model: str
    messages: list[dict[str, Any]]   # for the chat template: the instructions first, if any
    sampling: SamplingFields
    echo: dict[str, Any]             # the request's fields the Response object carries back
    stream: bool = False
    tools: ToolRequest | None = None
    options: RequestOptions = RequestOptions()   # safety_identifier / user, cache_salt, priority


def parse_responses_request(body: Any) -> ResponsesRequest:
    values = read_fields(Fields(body), REQUEST_FIELDS[PATH])
    text_format: TextFormat = (values["text"] or {}).get("format") or PLAIN_TEXT
    sampling = SamplingFields(
        max_tokens=values["max_output_tokens"], max_tokens_param="max_output_tokens",
        temperature=values["temperature"], top_p=values["top_p"],
        top_k=0 if values["top_k"] == -1 else values["top_k"], seed=values["seed"], ignore_eos=values["ignore_eos"],
        logit_bias=values["logit_bias"] or (), structured=text_format.structured)
    tools = _tool_request(values)
    if tools is not None and tools.choice.forced and sampling.structured is not None:
        raise bad_request(f"'tool_choice' {tools.choice.mode!r} and 'text.format' both constrain the reply; give "
                          "one.", "tool_choice", "invalid_value")
    user = values["safety_identifier"] or values["user"] or None
    options = RequestOptions(cache_salt=values["cache_salt"] or None, priority=values["priority"], user=user,
                             session_id=values["session_id"] or None)
    instructions = values["instructions"]
    messages = [{"role": "system", "content": instructions}] if instructions else []
    return ResponsesRequest(values["model"], [*messages, *values["input"]], sampling,
                            _echo(values, text_format), values["stream"], tools, options)


def _tool_request(values: dict[str, Any]) -> ToolRequest | None:
    tools = [function.tool for function in values["tools"]]
    choice = values["tool_choice"]
    if choice.name is not None and choice.name not in {tool.name for tool in tools}:
        raise invalid_value("tool_choice.name", "must be the name of one of the tools", choice.name)
    return tool_request({"tools": tools, "tool_choice": choice, "parallel_tool_calls": values["parallel_tool_calls"]})


def _echo(values: dict[str, Any], text_format: TextFormat) -> dict[str, Any]:
    choice: ToolChoice = values["tool_choice"]
    return {"instructions": values["instructions"], "max_output_tokens": values["max_output_tokens"],
            "metadata": values["metadata"] or {}, "parallel_tool_calls": values["parallel_tool_calls"],
            "text": {"format": text_format.echo},   # temperature and top_p: the route's, as sampled
            "tool_choice": {"type": "function", "name": choice.name} if choice.name is not None else choice.mode,
            "tools": [function.echo() for function in values["tools"]],
            "user": values["user"], "safety_identifier": values["safety_identifier"]}


# ---- the fields ------------------------------------------------------------------------
def _tools(value: list[Any]) -> list[FunctionTool]:
    if len(value) > MAX_TOOLS:
        raise invalid_value("tools", f"at most {MAX_TOOLS} tools", f"{len(value)} tools")
    return [_tool(item, f"tools[{i}]") for i, item in enumerate(value)]


def _tool(item: Any, where: str) -> FunctionTool:
    """A function tool; OpenAI's hosted tools (web search, file search, ...) run at
    OpenAI, so they are refused here."""
    if not isinstance(item, dict):
        raise invalid_type(where, "an object", item)
    if item.get("type") != "function":
        raise invalid_value(f"{where}.type", "only function tools are supported (web_search, file_search and "
                                             "OpenAI's other hosted tools run at OpenAI)", item.get("type"))
    fields = Fields(item, f"{where}.")
    name = fields.string("name", required=True) or ""
    parameters = fields.raw("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid_type(f"{where}.parameters", "an object (a JSON schema)", parameters)
    check_object_schema(parameters, f"{where}.parameters")
    strict = fields.raw("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_type(f"{where}.strict", "a boolean", strict)
    try:
        # The Responses API's function tools are strict unless they say otherwise.
        tool = Tool(name, parameters or {"type": "object", "properties": {}}, fields.string("description"),
                    strict=strict is not False)
    except UsageError as error:
        raise invalid_value(f"{where}.name", error.message, name) from error
    return FunctionTool(tool)


def _tool_choice(value: Any) -> ToolChoice:
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise invalid_value("tool_choice", 'must be auto, none, required or {"type": "function", "name": ...}',
                                value)
        return ToolChoice(value)
    if not isinstance(value, dict):
        raise invalid_type("tool_choice", "a string or an object", value)
    if value.get("type") != "function":
        raise invalid_value("tool_choice.type", "must be function (hosted tools and allowed_tools are not "
                                                "supported)", value.get("type"))
    return ToolChoice("function", Fields(value, "tool_choice.").string("name", required=True))


def _text_format(value: Any) -> TextFormat:
    if not isinstance(value, dict):
        raise invalid_type("text.format", "an object", value)
    fields = Fields(value, "text.format.")
    kind = fields.string("type", required=True)
    if kind not in FORMATS:
        raise invalid_value("text.format.type", f"must be one of {', '.join(FORMATS)}", kind)
    if kind == "text":
        return PLAIN_TEXT
    if kind == "json_object":
        return TextFormat(Structured(GrammarSpec.json_object(), "text.format", strict=False), {"type": kind})
    name = fields.string("name", required=True)
    schema = fields.object("schema")
    if schema is None:
        raise bad_request("Missing required parameter: 'text.format.schema'.", "text.format.schema",
                          "missing_required_parameter")
    strict, description = fields.raw("strict"), fields.string("description")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_type("text.format.strict", "a boolean", strict)
    spec = grammar_spec("json_schema", schema.body, "text.format.schema")
    echo = {"type": kind, "name": name, "schema": schema.body, "strict": strict}
    return TextFormat(Structured(spec, "text.format", strict=bool(strict)),
                      {**echo, "description": description} if description is not None else echo)


def _metadata(metadata: Fields) -> dict[str, str]:
    keys, key_length, value_length = MAX_METADATA
    if len(metadata.body) > keys:
        raise invalid_value("metadata", f"at most {keys} keys", f"{len(metadata.body)} keys")
    for key, value in metadata.body.items():
        if len(key) > key_length:
            raise invalid_value("metadata", f"keys must be at most {key_length} characters", key)
        if not isinstance(value, str):
            raise invalid_type(f"metadata.{key}", "a string", value)
        if len(value) > value_length:
            raise invalid_value(f"metadata.{key}", f"at most {value_length} characters", value)
    return dict(metadata.body)


def _include(value: list[Any]) -> tuple[str, ...]:
    """What else the Response should hold; none of it exists here but logprobs, which
    this route does not give (the chat route does)."""
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise invalid_type(f"include[{i}]", "a string", item)
        if item == LOGPROBS:
            raise bad_request(f"'include[{i}]': {LOGPROBS} is not supported on this route (/v1/chat/completions "
                              "gives logprobs).", f"include[{i}]", "unsupported_parameter")
    return tuple(value)


def _refused(name: str, why: str) -> Callable[[Any], Any]:
    """A field whose every value but false (null is absent anyway) is a 400."""

    def parse(value: Any) -> Any:
        if value is False:
            return False
        raise bad_request(f"'{name}' is not supported: {why}", name, "unsupported_parameter")

    return parse


_STRING = {"type": "string"}
_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string", "pattern": TOOL_NAME.pattern},
    "description": {"type": ["string", "null"]},
    "parameters": {"type": ["object", "null"], "description": "A JSON schema of the arguments."},
    "strict": {"type": ["boolean", "null"], "description": "Whether the call's arguments follow the schema by "
                                                           "grammar: true unless false (echoed as applied)."}}}
_TOOL_CHOICE = {"anyOf": [{"enum": list(TOOL_CHOICES)}, {"type": "object", "required": ["type", "name"],
                                                         "properties": {"type": {"const": "function"},
                                                                        "name": _STRING}}]}
_FORMAT = {"anyOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "name", "schema"], "properties": {
        "type": {"const": "json_schema"}, "name": _STRING, "description": _STRING,
        "schema": {"type": "object", "description": "The JSON schema the reply must match."},
        "strict": {"type": "boolean"}}}]}
_METADATA = {"type": "object", "maxProperties": MAX_METADATA[0], "propertyNames": {"maxLength": MAX_METADATA[1]},
             "additionalProperties": {"type": "string", "maxLength": MAX_METADATA[2]}}
_NOT_STORED = {"type": "null", "description": f"Refused: {STATELESS}"}
_SHARED = {spec.name: spec for spec in (*SAMPLING, *SERVING)}

RESPONSES_FIELDS = (
    MODEL,
    Field("input", None, "A string (the user's message), or message, function_call and function_call_output "
                         "items.", required=True, parse=parse_input, schema=INPUT_SCHEMA),
    Field("instructions", "string", "A system message put before the input."),
    Field("max_output_tokens", "integer", "Most tokens to generate (default: the endpoint's, see /v1/models).",
          low=1),
    _SHARED["temperature"], _SHARED["top_p"],
    Field("tools", "array", "Functions the model may call (hosted tools are refused).", (), parse=_tools,
          schema={"type": "array", "maxItems": MAX_TOOLS, "items": _TOOL}),
    Field("tool_choice", None, "Whether and which function the model must call.", ToolChoice(), parse=_tool_choice,
          schema=_TOOL_CHOICE),
    Field("parallel_tool_calls", "boolean", "Whether one reply may hold several calls.", True),
    Field("text", "object", properties=(
        Field("format", None, "Plain text, or a reply constrained to JSON or to a JSON schema.",
              parse=_text_format, schema=_FORMAT),
        Field("verbosity", "string", "Accepted and ignored.", enum=("low", "medium", "high")))),
    Field("stream", "boolean", "Send the reply as the Responses API's server-sent events, response.created to "
                               "response.completed (or response.incomplete).", False),
    Field("metadata", "object", "Up to 16 string pairs, echoed in the response.", parse=_metadata,
          schema=_METADATA),
    Field("safety_identifier", "string", "Who the request is for: kept with the request, logged."),
    Field("user", "string", "safety_identifier under its older name (the newer one wins)."),
    Field("store", "boolean", "Accepted and ignored: nothing is stored (the response reads store: false).", False),
    Field("previous_response_id", None, parse=_refused("previous_response_id", STATELESS), schema=_NOT_STORED),
    Field("conversation", None, parse=_refused("conversation", STATELESS), schema=_NOT_STORED),
    # A prompt template stored on OpenAI's side: its instructions had been silently left out.
    Field("prompt", None, parse=_refused("prompt", "prompt templates live on OpenAI's platform; send their "
                                                   "text as 'instructions' and 'input'."), schema=_NOT_STORED),
    Field("background", "boolean", "Only false: a reply runs while its request waits.", False,
          parse=_refused("background", "a reply runs while its request waits (nothing is stored to poll)."),
          schema={"const": False}),
    Field("include", "array", f"Accepted; {LOGPROBS} is refused.", (), parse=_include,
          schema={"type": "array", "items": {"type": "string", "not": {"const": LOGPROBS}}}),
    Field("truncation", "string", "Accepted; nothing is ever dropped (a conversation beyond the context is a 400).",
          "disabled", enum=("auto", "disabled")),
    # ruvllm's and vLLM's extensions, which OpenAI's SDK sends through `extra_body`.
    _SHARED["top_k"], _SHARED["seed"], _SHARED["ignore_eos"], _SHARED["logit_bias"], _SHARED["cache_salt"],
    _SHARED["priority"], _SHARED["session_id"],
)
REQUEST_FIELDS: dict[str, tuple[Field, ...]] = {PATH: RESPONSES_FIELDS}
