"""Request bodies of /v1/chat/completions and /v1/completions, parsed into typed
dataclasses. Every malformed field is a 400 naming the offending `param`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Union

from ruvllm_cli.engine.sampling import SamplingKnobs, SamplingParams
from ruvllm_cli.engine.tools import ToolRequest
from ruvllm_cli.errors import UsageError
from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import Fields, invalid_type, invalid_value
from ruvllm_cli.server.structured import Structured, parse_logit_bias, parse_structured
from ruvllm_cli.server.tool_fields import parse_tool_request

MAX_N = 128
MAX_STOP = 4
MAX_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**64 - 1)   # what torch.Generator.manual_seed accepts
ROLES = {"system", "developer", "user", "assistant", "tool"}
# One request fills at most one default batch (--max-concurrent 16), so a 1 KB body
# cannot take the whole queue (80 sequences by default) from everyone else.
DEFAULT_MAX_SEQUENCES = 16
DEFAULT_MAX_PROMPTS = 16   # a prompt list longer than this fails the sequence cap anyway
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

Prompt = Union[str, list[int]]


@dataclass(frozen=True)
class RequestLimits:
    """A server's caps on the work one request may ask for (each a 400 beyond it)."""

    max_prompts: int = DEFAULT_MAX_PROMPTS       # entries of a completion's `prompt` list
    max_sequences: int = DEFAULT_MAX_SEQUENCES   # prompts x `n`

    def within(self, capacity: int) -> "RequestLimits":
        """These limits, with no more sequences than a server of `capacity` ever holds."""
        return RequestLimits(self.max_prompts, min(self.max_sequences, capacity))


@dataclass(frozen=True)
class SamplingFields(SamplingKnobs):
    """The sampling fields both endpoints share. `max_tokens` None: up to the context,
    or at most `default_max_tokens` where the endpoint has such a default."""

    max_tokens: int | None = None
    default_max_tokens: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # alternatives per token; None: no logprobs at all
    cache_salt: str | None = None     # prefix-cache blocks are shared only within one salt
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: Structured | None = None   # response_format / structured_outputs
    skip_special_tokens: bool = True       # False while tool-call markers must reach the parser

    def params(self, max_tokens: int, copy: int) -> SamplingParams:
        """Engine parameters for copy `copy` of `n`."""
        # The n copies of one prompt must differ, yet a seeded request must replay
        # exactly: copy i samples with seed + i (wrapped into torch's seed range).
        seed = None if self.seed is None else (self.seed + copy) % 2**64
        try:
            return SamplingParams(**{**self.knobs(), "seed": seed}, max_tokens=max_tokens, stop=self.stop,
                                  ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                                  logit_bias=self.logit_bias, skip_special_tokens=self.skip_special_tokens,
                                  structured=self.structured.spec if self.structured else None)
        except UsageError as error:
            name = error.message.split(" ", 1)[0]
            raise bad_request(error.message, name if hasattr(self, name) else None) from error


@dataclass(frozen=True)
class StreamFields:
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]    # ready for the chat template
    sampling: SamplingFields
    streaming: StreamFields
    tools: ToolRequest | None = None


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: list[Prompt]
    sampling: SamplingFields
    streaming: StreamFields
    echo: bool = False


# ---- chat ---------------------------------------------------------------------------
def parse_chat_request(body: Any, limits: RequestLimits = RequestLimits()) -> ChatRequest:
    fields = Fields(body)
    model = _model(fields)
    messages = parse_messages(fields.required("messages"))
    tools = parse_tool_request(fields)
    logprobs = fields.boolean("logprobs")
    top = fields.integer("top_logprobs", None, low=0, high=MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
    max_tokens = fields.integer("max_completion_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", None, low=1)
    sampling = _sampling(fields, max_tokens, (top or 0) if logprobs else None)
    _check_sequences(1, sampling.n, limits)
    if tools is not None and tools.choice.forced and sampling.structured is not None:
        raise bad_request(f"'tool_choice' {tools.choice.mode!r} and '{sampling.structured.param}' both "
                          "constrain the reply; give one.", "tool_choice", "invalid_value")
    return ChatRequest(model, messages, sampling, _streaming(fields), tools)


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid_type("messages", "an array", value)
    if not value:
        raise bad_request("'messages' must contain at least one message.", "messages")
    return [_message(item, f"messages[{i}]") for i, item in enumerate(value)]


def _message(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise invalid_type(where, "an object", item)
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid_value(f"{where}.role", f"must be one of {', '.join(sorted(ROLES))}", role)
    message: dict[str, Any] = {"role": "system" if role == "developer" else role}
    tool_calls = item.get("tool_calls")
    content_required = not (role == "assistant" and tool_calls)
    message["content"] = _content(item.get("content"), f"{where}.content", content_required)
    if tool_calls is not None:
        if role != "assistant" or not isinstance(tool_calls, list):
            raise invalid_value(f"{where}.tool_calls", "only assistant messages carry an array of tool calls",
                                tool_calls)
        message["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(tool_calls)]
    for key in ("name", "tool_call_id"):
        if item.get(key) is not None:
            if not isinstance(item[key], str):
                raise invalid_type(f"{where}.{key}", "a string", item[key])
            message[key] = item[key]
    return message


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """A past tool call for the template. OpenAI sends `arguments` as a JSON string;
    chat templates (Qwen, Llama 3) expect an object they can `tojson` themselves."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid_value(f"{where}.function", "must be an object with a name", function)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass   # not JSON: the template gets the text as it came
    return {**call, "function": {**function, "arguments": arguments}}


def _content(value: Any, where: str, required: bool) -> str | None:
    """A string, or text parts joined by newlines; any other part is refused."""
    if value is None:
        if required:
            raise bad_request(f"Missing required parameter: '{where}'.", where, "missing_required_parameter")
        return None
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid_type(where, "a string or an array of content parts", value)
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else part
            raise invalid_value(f"{where}[{i}].type", "only text content parts are supported", kind)
        if not isinstance(part.get("text"), str):
            raise invalid_type(f"{where}[{i}].text", "a string", part.get("text"))
        texts.append(part["text"])
    return "\n".join(texts)


# ---- completions ----------------------------------------------------------------------
def parse_completion_request(body: Any, limits: RequestLimits = RequestLimits()) -> CompletionRequest:
    fields = Fields(body)
    model = _model(fields)
    prompts = parse_prompts(fields.required("prompt"), limits.max_prompts)
    logprobs = fields.integer("logprobs", None, low=0, high=MAX_LOGPROBS)
    echo = fields.boolean("echo")
    if echo and logprobs is not None:
        raise bad_request("'echo' together with 'logprobs' is not supported.", "echo", "unsupported_parameter")
    if fields.string("suffix"):
        raise bad_request("'suffix' is not supported.", "suffix", "unsupported_parameter")
    sampling = _sampling(fields, fields.integer("max_tokens", None, low=1), logprobs,
                        default_max_tokens=COMPLETION_MAX_TOKENS)
    best_of = fields.integer("best_of", None, low=1)
    if best_of is not None and best_of != sampling.n:
        raise bad_request("'best_of' other than 'n' is not supported.", "best_of", "unsupported_parameter")
    _check_sequences(len(prompts), sampling.n, limits)
    return CompletionRequest(model, prompts, sampling, _streaming(fields), echo)


def parse_prompts(value: Any, max_prompts: int | None = None) -> list[Prompt]:
    """A string, an array of strings, an array of token ids, or an array of those
    (at most `max_prompts` of them)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid_type("prompt", "a string or an array", value)
    if not value:
        raise bad_request("'prompt' must not be empty.", "prompt")
    if all(_is_token_id(v) for v in value):
        return [list(value)]
    if max_prompts is not None and len(value) > max_prompts:
        raise bad_request(f"'prompt' holds {len(value)} prompts; this server takes at most {max_prompts} in one "
                          "request.", "prompt", "invalid_value")
    prompts: list[Prompt] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(_is_token_id(v) for v in item):
            prompts.append(list(item))
        else:
            raise invalid_type(f"prompt[{i}]", "a string or a non-empty array of token ids", item)
    return prompts


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sequences(num_prompts: int, n: int, limits: RequestLimits) -> None:
    total = num_prompts * n
    if total > limits.max_sequences:
        asked = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise bad_request(f"This request asks for {total} sequences ({asked}); this server generates at most "
                          f"{limits.max_sequences} for one request.", "n" if n > 1 else "prompt", "invalid_value")


# ---- shared ---------------------------------------------------------------------------
def _model(fields: Fields) -> str:
    model = fields.string("model", required=True)
    if not model:
        raise bad_request("Missing required parameter: 'model'.", "model", "missing_required_parameter")
    return model


def _sampling(fields: Fields, max_tokens: int | None, logprobs: int | None,
              default_max_tokens: int | None = None) -> SamplingFields:
    top_p = fields.number("top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise invalid_value("top_p", "must be greater than 0 and at most 1", top_p)
    # vLLM's extensions (top_k, min_p, repetition_penalty, ignore_eos), which clients
    # send through `extra_body`.
    repetition_penalty = fields.number("repetition_penalty", 1.0, low=0.0, high=10.0)
    if repetition_penalty == 0.0:
        raise invalid_value("repetition_penalty", "must be greater than 0", repetition_penalty)
    return SamplingFields(
        max_tokens=max_tokens,
        default_max_tokens=default_max_tokens,
        n=fields.integer("n", 1, low=1, high=MAX_N) or 1,
        temperature=fields.number("temperature", 1.0, low=0.0, high=2.0),
        top_p=top_p,
        top_k=_top_k(fields),
        min_p=fields.number("min_p", 0.0, low=0.0, high=1.0),
        repetition_penalty=repetition_penalty,
        presence_penalty=fields.number("presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0, low=-2.0, high=2.0),
        seed=fields.integer("seed", None, low=SEED_RANGE[0], high=SEED_RANGE[1]),
        stop=_stop(fields.raw("stop")),
        ignore_eos=fields.boolean("ignore_eos"),
        logprobs=logprobs,
        cache_salt=fields.string("cache_salt") or None,
        logit_bias=parse_logit_bias(fields),
        structured=parse_structured(fields),
    )


def _top_k(fields: Fields) -> int:
    top_k = fields.integer("top_k", 0, low=-1)
    return 0 if top_k in (None, -1) else top_k   # vLLM spells "off" as -1


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid_type("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP:
        raise invalid_value("stop", f"at most {MAX_STOP} stop sequences", value)
    return tuple(value)


def _streaming(fields: Fields) -> StreamFields:
    stream = fields.boolean("stream")
    options = fields.object("stream_options")
    include_usage = options.boolean("include_usage") if options is not None else False
    return StreamFields(stream, include_usage and stream)


__all__ = ["ChatRequest", "CompletionRequest", "Prompt", "RequestLimits", "SamplingFields", "StreamFields",
           "parse_chat_request", "parse_completion_request", "parse_messages", "parse_prompts"]
