"""The bodies of Ollama's POST /api/chat, /api/generate and /api/show, read through
the same Field specs as the other routes (so /openapi.json documents them) into the
chat route's pieces. Ollama's `options` map onto our sampling fields; the options
that tune Ollama's own runner (num_ctx, num_gpu, num_thread, mirostat, ...) are
accepted and change nothing here, as Ollama itself ignores an option it does not
know. Every malformed field is a 400 naming its param."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from ruvllm_cli.engine.grammar import GrammarSpec
from ruvllm_cli.engine.tools import ToolRequest
from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import Fields, invalid_type, invalid_value, string_list
from ruvllm_cli.server.messages import CONTENT_SCHEMA, parse_messages
from ruvllm_cli.server.protocol import MODEL, SEED_RANGE, SamplingFields, TemplateOptions
from ruvllm_cli.server.spec import Field, read_fields
from ruvllm_cli.server.structured import Structured, grammar_spec
from ruvllm_cli.server.tool_fields import TOOL_FIELDS, tool_request

CHAT_PATH = "/api/chat"
GENERATE_PATH = "/api/generate"
SHOW_PATH = "/api/show"
MAX_STOP = 16
# Go's time.ParseDuration units, which Ollama's keep_alive takes ("5m", "1h30m", "-1s").
_DURATION = re.compile(r"^-?(?:\d+(?:\.\d*)?(?:ns|us|µs|ms|s|m|h))+$")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# What `think` may be: on, off, or gpt-oss's effort levels (which also turn it on).
THINK_LEVELS = ("low", "medium", "high")


@dataclass(frozen=True)
class OllamaJob:
    """One /api/chat or /api/generate request. `messages` None: a raw prompt
    (`raw: true`, or a model without a chat template), `prompt` its text; both
    empty: Ollama's load (or, with keep_alive 0, unload) request."""

    model: str
    messages: list[dict[str, Any]] | None
    prompt: str
    sampling: SamplingFields
    stream: bool = True
    tools: ToolRequest | None = None
    template: TemplateOptions = TemplateOptions()
    think: bool | None = None         # None: not asked (a reasoning model's thinking still comes apart)
    keep_alive: float | None = None   # seconds; negative: for ever; None: not given
    empty: bool = False
    # options.num_predict was given: -1 and -2 (Ollama's default) run until the context
    # is full; without it a reply stops at the server's --max-tokens-default, as on /v1.
    length_given: bool = False

    @property
    def unload(self) -> bool:
        return self.empty and self.keep_alive == 0


def parse_chat(body: Any) -> OllamaJob:
    values = read_fields(Fields(body), REQUEST_FIELDS[CHAT_PATH])
    messages = values["messages"]
    tools = tool_request({"tools": values["tools"], "tool_choice": values["tool_choice"],
                          "parallel_tool_calls": True})
    if tools is not None and tools.choice.forced and values["format"] is not None:
        raise bad_request("'tool_choice' and 'format' both constrain the reply; give one.", "tool_choice",
                          "invalid_value")
    return OllamaJob(values["model"], messages, "", _sampling(values), values["stream"], tools,
                     _template(values["think"]), _think(values["think"]), values["keep_alive"], not messages,
                     _length_given(values))


def parse_generate(body: Any) -> OllamaJob:
    values = read_fields(Fields(body), REQUEST_FIELDS[GENERATE_PATH])
    reasons = {"suffix": "ruvllm has no fill-in-the-middle prompts (text after the insertion point)",
               "template": "ruvllm renders prompts with the model's own chat template"}
    for name, reason in reasons.items():
        if values[name]:
            raise bad_request(f"'{name}' is not supported: {reason}.", name, "unsupported_parameter")
    if values["context"]:
        raise bad_request("'context' (deprecated by Ollama) is not supported: send the conversation to /api/chat.",
                          "context", "unsupported_parameter")
    prompt, system = values["prompt"], values["system"]
    if values["raw"]:
        messages = None
        if system:
            raise bad_request("'system' has no place in a raw prompt: write it into 'prompt'.", "system",
                              "invalid_value")
    else:
        messages = [*([{"role": "system", "content": system}] if system else []),
                    {"role": "user", "content": prompt}]
    return OllamaJob(values["model"], messages, prompt, _sampling(values), values["stream"], None,
                     _template(values["think"]), _think(values["think"]), values["keep_alive"], not prompt,
                     _length_given(values))


def _length_given(values: dict[str, Any]) -> bool:
    return "num_predict" in (values["options"] or {})


def _think(value: bool | str | None) -> bool | None:
    return value if value is None or isinstance(value, bool) else True


def _template(think: bool | str | None) -> TemplateOptions:
    """`think` as the chat template's variables: Qwen3's `enable_thinking`, and an
    effort level as gpt-oss's `reasoning_effort`."""
    if think is None:
        return TemplateOptions()
    kwargs: dict[str, Any] = {"enable_thinking": bool(think)}
    if isinstance(think, str):
        kwargs["reasoning_effort"] = think
    return TemplateOptions(kwargs)


# Ollama's own defaults (its api.DefaultOptions) for the options a request and the
# model's generation_config.json leave unset. Its repeat_penalty 1.1 stays off: Ollama's
# own Go sampler, which runs its newer models, applies no penalty either.
OLLAMA_SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}
# repeat_last_n's default: the penalties (a request's, or the model's recommended
# repetition penalty) look at the last 64 tokens of prompt and reply, as Ollama's
# llama.cpp runner does; 0 turns them off, -1 looks at the whole context.
REPEAT_LAST_N = 64
WHOLE_CONTEXT = 2**31 - 1


def _sampling(values: dict[str, Any]) -> SamplingFields:
    options = values["options"] or {}
    structured = values["format"]
    predict = options.get("num_predict")
    # Ollama's sampler: seed -1 (its default, which clients send) is no seed, top_k at
    # or below 0 is off, and top_p 0 keeps the likeliest token alone.
    seed = None if options.get("seed") == -1 else options.get("seed")
    top_k = options.get("top_k")
    top_k = 0 if top_k is not None and top_k < 0 else top_k
    top_p = options.get("top_p")
    if top_p == 0.0:
        top_p, top_k = None, 1
    return SamplingFields(
        # An upper bound, as Ollama's: a reply stops where the context ends, whatever it asked.
        default_max_tokens=predict if predict is not None and predict > 0 else None,
        max_tokens_param="options.num_predict",
        stop=tuple(options.get("stop") or ()),
        # Unset, these five take the model's recommendation, else OLLAMA_SAMPLING (the route).
        temperature=options.get("temperature"), top_p=top_p, top_k=top_k,
        min_p=options.get("min_p"), seed=seed, structured=structured, **_penalties(options))


def _penalties(options: dict[str, Any]) -> dict[str, Any]:
    """The penalties, over repeat_last_n as the engine's window: 0 turns every penalty
    off (the model's recommended one too), -1 is the whole context, unset is 64 (Ollama's)."""
    last_n = options.get("repeat_last_n")
    if last_n == 0:
        return {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    return {"repetition_penalty": options.get("repeat_penalty"),
            "presence_penalty": _given(options, "presence_penalty", 0.0),
            "frequency_penalty": _given(options, "frequency_penalty", 0.0),
            "penalty_last_n": WHOLE_CONTEXT if last_n == -1 else REPEAT_LAST_N if last_n is None else last_n}


def _given(options: dict[str, Any], name: str, default: Any) -> Any:
    value = options.get(name)
    return default if value is None else value


# ---- the fields ------------------------------------------------------------------------
def _ollama_messages(value: Any) -> list[dict[str, Any]]:
    """Ollama's messages as the chat route's: a tool result names its tool
    (`tool_name`) where OpenAI's names the call, so each gets the id of the latest
    call of that name; past calls' arguments are objects already; `thinking` is an
    earlier turn's reasoning. An empty list is Ollama's load request."""
    if not isinstance(value, list):
        raise invalid_type("messages", "an array", value)
    if not value:
        return []
    converted: list[dict[str, Any]] = []
    unanswered: dict[str, list[str]] = {}   # a tool's calls not yet answered, oldest first
    numbered = 0
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            raise invalid_type(where, "an object", item)
        if item.get("images"):
            raise invalid_value(f"{where}.images", "images are not supported: ruvllm serves text models", "[...]")
        message = {key: item[key] for key in ("role", "content", "tool_calls", "name") if key in item}
        if item.get("thinking") is not None:
            message["reasoning_content"] = item["thinking"]
        if isinstance(item.get("tool_calls"), list):
            message["tool_calls"] = [_past_call(call, numbered + n) for n, call in enumerate(item["tool_calls"])]
            numbered += len(item["tool_calls"])
            for call in message["tool_calls"]:
                if isinstance(call, dict) and isinstance(call.get("function"), dict) \
                        and isinstance(call["function"].get("name"), str):
                    unanswered.setdefault(call["function"]["name"], []).append(call["id"])
        tool = item.get("tool_name") or item.get("name")
        if item.get("role") == "tool" and item.get("tool_call_id") is None:
            # the oldest call of that tool not answered yet (two calls of one tool: in order)
            queue = unanswered.get(tool) if isinstance(tool, str) else None
            if queue:
                message["tool_call_id"] = queue.pop(0)
            else:   # answers no call we know of: an id of its own
                message["tool_call_id"], numbered = f"call_{numbered}", numbered + 1
            if isinstance(tool, str):
                message["name"] = tool
        elif item.get("tool_call_id") is not None:
            message["tool_call_id"] = item["tool_call_id"]
        if item.get("role") == "assistant" and message.get("content") == "" and message.get("tool_calls"):
            message["content"] = None
        converted.append(message)
    return parse_messages(converted)


def _past_call(call: Any, number: int) -> Any:
    if not isinstance(call, dict):
        return call
    return {"id": call.get("id") or f"call_{number}", "type": "function", **call}


def _format(value: Any) -> Structured | None:
    """`format`: "json" (any JSON object), a JSON schema, or "" (none)."""
    if value == "":
        return None
    if value == "json":
        return Structured(GrammarSpec.json_object(), "format", strict=False)
    if not isinstance(value, dict):
        raise invalid_value("format", 'must be "json" or a JSON schema object', value)
    return Structured(grammar_spec("json_schema", value, "format"), "format")


def _no_images(value: list[Any]) -> None:
    if value:
        raise invalid_value("images", "images are not supported: ruvllm serves text models", "[...]")


def _think_value(value: Any) -> bool | str:
    if isinstance(value, bool) or value in THINK_LEVELS:
        return value
    raise invalid_value("think", f"must be true, false or one of {', '.join(THINK_LEVELS)}", value)


def parse_keep_alive(value: Any) -> float:
    """Seconds: a number, or a duration as Ollama takes it ("5m", "1h30m", "-1")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            if math.isfinite(number):
                return number
        if _DURATION.match(text):
            sign = -1.0 if text.startswith("-") else 1.0
            parts = re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", text)
            return sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    raise invalid_value("keep_alive", 'must be seconds or a duration such as "5m" or "1h" (0: unload now, '
                                      "negative: keep loaded)", value)


def _stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise invalid_type("options.stop", "an array of strings", value)
    return string_list(value, "options.stop", MAX_STOP)


def _clamped(name: str, low: float, high: float | None = None) -> Callable[[float], float]:
    """A number Ollama's sampler takes into its range rather than refusing (its
    NewSampler: a negative temperature is greedy, top_p and min_p within [0, 1])."""
    def parse(value: float) -> float:
        if not math.isfinite(value):
            raise invalid_value(f"options.{name}", "must be a finite number", value)
        return max(low, value if high is None else min(value, high))

    return parse


def _whole(name: str, description: str, low: int, high: int | None = None) -> Field:
    """An integer option that also takes a whole float (8.0), as Ollama converts it."""
    def parse(value: Any) -> int:
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_type(f"options.{name}", "an integer", value)
        if value < low or (high is not None and value > high):
            bounds = f"at least {low}" if high is None else f"between {low} and {high}"
            raise invalid_value(f"options.{name}", f"must be {bounds}", value)
        return value

    schema: dict[str, Any] = {"type": "integer", "minimum": low, **({"maximum": high} if high is not None else {})}
    return Field(name, None, description, parse=parse, schema=schema)


def _options(fields: Fields) -> dict[str, Any]:
    """The options given (checked against _OPTION_FIELDS already), by name."""
    values = {name: value for name, value in read_fields(fields, _OPTION_FIELDS).items() if value is not None}
    if values.get("num_predict") == 0:
        raise invalid_value("options.num_predict", "must be at least 1, or -1 (until the context is full)", 0)
    return values


_OPTION_FIELDS = (
    Field("temperature", "number", "0 (or less): greedy; higher: more random (default: the model's "
                                   "generation_config.json value, else Ollama's 0.8).", parse=_clamped("temperature", 0.0)),
    Field("top_p", "number", "Nucleus sampling, taken into [0, 1] as Ollama does (0: the likeliest token alone; "
                             "default: the model's, else Ollama's 0.9).", parse=_clamped("top_p", 0.0, 1.0)),
    _whole("top_k", "Sample from the k likeliest tokens; 0 or less: off (default: the model's, else Ollama's 40).",
           SEED_RANGE[0]),
    Field("min_p", "number", "Drop tokens less likely than this times the likeliest one (taken into [0, 1]).",
          parse=_clamped("min_p", 0.0, 1.0)),
    Field("repeat_penalty", "number", "Divides the logits of tokens seen in the last repeat_last_n (1: off; "
                                      "default: the model's, else off).", low=0.0, high=10.0, above_low=True),
    _whole("repeat_last_n", "How many of the last tokens (prompt and reply) the penalties look at; 0: no penalty, "
                            "-1: the whole context (default 64).", -1),
    Field("presence_penalty", "number", low=-2.0, high=2.0),
    Field("frequency_penalty", "number", low=-2.0, high=2.0),
    _whole("seed", "Replays the same sampling; -1: a random seed, as unset (Ollama's default).", *SEED_RANGE),
    _whole("num_predict", "Most tokens to generate, at most what the context leaves; -1 or -2: until the context is "
                          "full (default: the server's --max-tokens-default).", -2),
    Field("stop", None, "Text that ends the reply (not included in it).", parse=_stop,
          schema={"type": "array", "maxItems": MAX_STOP, "items": {"type": "string"}}),
)
_OPTIONS = Field("options", "object", "Sampling options (Ollama's names). Options of Ollama's own runner "
                 "(num_ctx, num_gpu, num_thread, mirostat, ...) are accepted and change nothing: the context is "
                 "the server's (--max-context).", parse=_options, properties=_OPTION_FIELDS)
_FORMAT = Field("format", None, 'The reply\'s shape: "json" (a JSON object) or a JSON schema.', parse=_format,
                schema={"anyOf": [{"enum": ["", "json"]}, {"type": "object"}]})
_STREAM = Field("stream", "boolean", "One JSON object a line as the reply is generated (Ollama's default), or "
                                     "one object at the end (false).", True)
_KEEP_ALIVE = Field("keep_alive", None, "0 with no messages (or prompt): unload the model now. Otherwise "
                                        "accepted; models unload after the server's --keep-alive.",
                    parse=parse_keep_alive, schema={"anyOf": [{"type": "number"}, {"type": "string"}]})
_THINK = Field("think", None, "A reasoning model thinks (true, or gpt-oss's low/medium/high) or not (false); its "
                              "thinking comes back in `thinking`.", parse=_think_value,
               schema={"anyOf": [{"type": "boolean"}, {"enum": list(THINK_LEVELS)}]})

CHAT_FIELDS = (
    MODEL,
    Field("messages", "array", "The conversation (empty: load the model).", [], parse=_ollama_messages,
          schema={"type": "array", "items": {"type": "object", "required": ["role"], "properties": {
              "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
              "content": CONTENT_SCHEMA, "images": {"type": "array", "maxItems": 0},
              "thinking": {"type": "string"}, "tool_name": {"type": "string"},
              "tool_calls": {"type": "array"}}}}),
    # tool_choice: OpenAI's (auto, none, required, a named function), which Ollama lacks; a ruvllm extension.
    *TOOL_FIELDS[:2], _FORMAT, _OPTIONS, _STREAM, _KEEP_ALIVE, _THINK,
)
GENERATE_FIELDS = (
    MODEL,
    Field("prompt", "string", "The prompt, put through the model's chat template unless `raw` (empty: load the "
                              "model).", ""),
    Field("system", "string", "A system prompt before it.", ""),
    Field("raw", "boolean", "The prompt as it is, without the chat template.", False),
    Field("suffix", "string", "Not supported (fill-in-the-middle)."),
    Field("template", "string", "Not supported: the model's own chat template renders the prompt."),
    Field("context", "array", "Not supported (deprecated by Ollama).", parse=lambda value: value,
          schema={"type": "array", "maxItems": 0}),
    Field("images", "array", "Not supported: ruvllm serves text models.", parse=_no_images,
          schema={"type": "array", "maxItems": 0}),
    _FORMAT, _OPTIONS, _STREAM, _KEEP_ALIVE, _THINK,
)
SHOW_FIELDS = (Field("model", "string", "One of the names /api/tags lists."),
               Field("name", "string", "`model` under its older name."),
               Field("verbose", "boolean", "Accepted; the answer is the same.", False))


def parse_show(body: Any) -> str:
    values = read_fields(Fields(body), SHOW_FIELDS)
    name = values["model"] or values["name"]
    if not name:
        raise bad_request("Missing required parameter: 'model'.", "model", "missing_required_parameter")
    return name
REQUEST_FIELDS: dict[str, tuple[Field, ...]] = {CHAT_PATH: CHAT_FIELDS, GENERATE_PATH: GENERATE_FIELDS,
                                               SHOW_PATH: SHOW_FIELDS}
