"""Request bodies of /v1/chat/completions and /v1/completions, parsed into typed
dataclasses. Every malformed field is a 400 naming the offending `param`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Union

from ruvllm_cli.engine.request import RequestOptions
from ruvllm_cli.engine.sampling import (MODEL_SAMPLING_FIELDS, SEED_RANGE, ReasoningBlock, SamplingKnobs,
                                        SamplingParams)
from ruvllm_cli.engine.tools import ToolRequest
from ruvllm_cli.errors import UsageError
from ruvllm_cli.server.errors import bad_request
from ruvllm_cli.server.fields import Fields, invalid_type, invalid_value, string_list
from ruvllm_cli.server.messages import MESSAGES
from ruvllm_cli.server.spec import Field, read_fields
from ruvllm_cli.server.structured import LOGIT_BIAS, STRUCTURED_FIELDS, Structured, pick_structured
from ruvllm_cli.server.tool_fields import TOOL_FIELDS, tool_request

MAX_N = 128
MAX_STOP = 4
MAX_LOGPROBS = 20
# One request fills at most one default batch (--max-concurrent 16), so a 1 KB body
# cannot take the whole queue (80 sequences by default) from everyone else.
DEFAULT_MAX_SEQUENCES = 16
DEFAULT_MAX_PROMPTS = 16   # a prompt list longer than this fails the sequence cap anyway
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

Prompt = Union[str, list[int]]
_KNOB_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingKnobs)}
# Said of each knob a model may recommend, in its description (the default is the model's).
MODEL_DEFAULT = "default: the model's generation_config.json value, else"


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

    # The knobs a model may recommend (MODEL_SAMPLING_FIELDS): None, or not given, is
    # unset (`unset`): the API's default here, the model's in with_defaults.
    temperature: float = None          # type: ignore[assignment]
    top_p: float = None                # type: ignore[assignment]
    top_k: int = None                  # type: ignore[assignment]
    min_p: float = None                # type: ignore[assignment]
    repetition_penalty: float = None   # type: ignore[assignment]
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"   # the field it came from, for errors
    n: int = 1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # alternatives per token; None: no logprobs at all
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: Structured | None = None   # response_format / structured_outputs
    reasoning_block: ReasoningBlock | None = None   # a reasoning model's block (prompts.reasoning_sampling)
    thinking_budget: int | None = None     # most tokens in it (Anthropic's thinking.budget_tokens)
    kept_special_tokens: tuple[str, ...] = ()   # a tool-call format's markers, for its parser
    stop_fence: str | None = None               # where a call opens: `stop` applies before it (tool_sampling)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    penalty_last_n: int | None = None     # the penalties' window (Ollama's repeat_last_n; SamplingParams')
    unset: frozenset[str] = frozenset()   # the knobs above the request left out

    def __post_init__(self) -> None:
        left = {name for name in MODEL_SAMPLING_FIELDS if getattr(self, name) is None}
        if left:
            object.__setattr__(self, "unset", self.unset | left)
            for name in left:
                object.__setattr__(self, name, _KNOB_DEFAULTS[name])

    def with_defaults(self, defaults: Mapping[str, Any]) -> "SamplingFields":
        """These fields with the knobs the request left out set from `defaults` (a model's
        recommended sampling, LLMEngine.sampling_defaults), where it has them."""
        chosen = {name: value for name, value in defaults.items() if name in self.unset}
        return dataclasses.replace(self, **chosen) if chosen else self

    def params(self, max_tokens: int, copy: int) -> SamplingParams:
        """Engine parameters for copy `copy` of `n`."""
        # The n copies of one prompt must differ, yet a seeded request must replay
        # exactly: copy i samples with seed + i (wrapped into torch's seed range).
        seed = None if self.seed is None else (self.seed + copy) % 2**64
        try:
            return SamplingParams(**{**self.knobs(), "seed": seed}, max_tokens=max_tokens, stop=self.stop,
                                  ignore_eos=self.ignore_eos, logprobs=self.logprobs,
                                  logit_bias=self.logit_bias, kept_special_tokens=self.kept_special_tokens,
                                  stop_fence=self.stop_fence,
                                  structured=self.structured.spec if self.structured else None,
                                  reasoning_block=self.reasoning_block, thinking_budget=self.thinking_budget,
                                  min_tokens=min(self.min_tokens, max_tokens), stop_token_ids=self.stop_token_ids,
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  skip_special_tokens=self.skip_special_tokens, penalty_last_n=self.penalty_last_n)
        except UsageError as error:
            name = error.message.split(" ", 1)[0]
            raise bad_request(error.message, name if hasattr(self, name) else None) from error


@dataclass(frozen=True)
class StreamFields:
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class TemplateOptions:
    """How the messages go through the chat template (vLLM's fields)."""

    kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]    # ready for the chat template
    sampling: SamplingFields
    streaming: StreamFields
    tools: ToolRequest | None = None
    options: RequestOptions = RequestOptions()   # cache_salt, priority, user, session_id
    template: TemplateOptions = TemplateOptions()
    include_reasoning: bool = True


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompts: list[Prompt]
    sampling: SamplingFields
    streaming: StreamFields
    echo: bool = False
    options: RequestOptions = RequestOptions()


# ---- the fields ------------------------------------------------------------------------
def _stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise invalid_type("stop", "a string or an array of strings", value)
    return string_list(value, "stop", MAX_STOP)   # names the item that is no string: stop[1]


MAX_STOP_TOKEN_IDS = 64


def _token_id_list(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise invalid_type("stop_token_ids", "an array of token ids (non-negative integers)", value)
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise invalid_value("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids", value)
    return tuple(value)


def parse_prompts(value: Any) -> list[Prompt]:
    """A string, an array of strings, an array of token ids, or an array of those."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise invalid_type("prompt", "a string or an array", value)
    if not value:
        raise bad_request("'prompt' must not be empty.", "prompt")
    if _all_numbers(value):
        return [_token_ids(value, "prompt")]
    prompts: list[Prompt] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and _all_numbers(item):
            prompts.append(_token_ids(item, f"prompt[{i}]"))
        else:
            raise invalid_type(f"prompt[{i}]", "a string or a non-empty array of token ids", item)
    return prompts


def _all_numbers(values: list[Any]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _token_ids(values: list[Any], where: str) -> list[int]:
    """Numbers meant as token ids: the first that is not an integer is named (not the
    whole list, as when [1, 2.0] was reported as prompt[0] not being a string)."""
    for i, value in enumerate(values):
        if not isinstance(value, int):
            raise invalid_type(f"{where}[{i}]", "an integer (a token id)", value)
    return list(values)


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": MAX_STOP, "items": {"type": "string"}}]}

MODEL = Field("model", "string", "One of the names /v1/models lists.", required=True)
_TEXT = {"type": "string", "minLength": 1}   # an empty prompt is refused
PROMPT = Field("prompt", None, "A string, an array of strings, token ids, or an array of token-id arrays.",
               required=True, parse=parse_prompts, schema={"anyOf": [
                   _TEXT, _TOKEN_IDS, {"type": "array", "minItems": 1, "items": {"anyOf": [_TEXT, _TOKEN_IDS]}}]})
MAX_TOKENS = Field("max_tokens", "integer", "Most tokens to generate (default: the endpoint's, see /v1/models).",
                   low=1)
SAMPLING = (
    Field("top_p", "number", "Nucleus sampling: the smallest set of tokens holding this much probability "
                             f"({MODEL_DEFAULT} 1).", low=0.0, high=1.0, above_low=True),
    # vLLM's extensions (top_k, min_p, repetition_penalty, ignore_eos), which clients
    # send through `extra_body`.
    Field("repetition_penalty", "number", f"Divides the logits of tokens already seen (1: off; {MODEL_DEFAULT} 1).",
          low=0.0, high=10.0, above_low=True),
    Field("n", "integer", "Replies to generate for each prompt.", 1, low=1, high=MAX_N),
    Field("temperature", "number", f"0: greedy; higher: more random ({MODEL_DEFAULT} 1).", low=0.0, high=2.0),
    Field("top_k", "integer", f"Sample from the k likeliest tokens (0 or -1: off; {MODEL_DEFAULT} off).", low=-1),
    Field("min_p", "number", f"Drop tokens less likely than this times the likeliest one ({MODEL_DEFAULT} 0).",
          low=0.0, high=1.0),
    Field("presence_penalty", "number", default=0.0, low=-2.0, high=2.0),
    Field("frequency_penalty", "number", default=0.0, low=-2.0, high=2.0),
    Field("seed", "integer", "Replays the same sampling (copy i of n uses seed + i).",
          low=SEED_RANGE[0], high=SEED_RANGE[1]),
    Field("stop", None, "Text that ends the reply (not included in it).", (), parse=_stop, schema=_STOP),
    Field("ignore_eos", "boolean", "Generate max_tokens tokens whatever the model says.", False),
    Field("min_tokens", "integer", "Tokens to generate before EOS or stop_token_ids may end the reply "
                                   "(vLLM's; stop strings still apply).", 0, low=0),
    Field("stop_token_ids", None, "Token ids that end the reply, beside the model's EOS (vLLM's).", (),
          parse=_token_id_list, schema={"type": "array", "maxItems": MAX_STOP_TOKEN_IDS,
                                        "items": {"type": "integer", "minimum": 0}}),
    Field("include_stop_str_in_output", "boolean", "Keep the stop string that ended the reply in it (vLLM's).",
          False),
    Field("skip_special_tokens", "boolean", "Leave special tokens out of the text (vLLM's).", True),
    Field("prompt_logprobs", "integer", "Not supported: refused (vLLM's field)."),
    LOGIT_BIAS,
    *STRUCTURED_FIELDS,
)
# How the request is served beside others: not sampling, the same on both endpoints.
SERVING = (
    Field("cache_salt", "string", "Prefix-cache blocks are shared only between requests with the same salt."),
    Field("priority", "integer", "Scheduling priority under --scheduling-policy priority: lower goes first "
                                 "(vLLM's field); waiting improves it by 0.1 per second.", 0,
          low=-1_000_000, high=1_000_000),
    Field("user", "string", "Who the request is for (OpenAI's field): kept with the request, logged."),
    Field("session_id", "string", "A conversation's id: kept with the request, logged."),
)
STREAMING = (
    Field("stream", "boolean", "Send the reply as server-sent events, ending with `data: [DONE]`.", False),
    Field("stream_options", "object", properties=(
        Field("include_usage", "boolean", "A last chunk with the token counts.", False),)),
)
def _template_kwargs(fields: Fields) -> dict[str, Any]:
    from ruvllm_cli.engine.chat_template import RESERVED_TEMPLATE_KWARGS

    for key in fields.body:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise invalid_value(f"chat_template_kwargs.{key}", "is set by the server, not by this object", key)
    return dict(fields.body)


def _deprecated(legacy: str, now: str, value: Any) -> None:
    """OpenAI's pre-2023 function fields had been ignored: the model saw no functions
    and a forced call was dropped under a 200 (a helper's pass); a client learns it now."""
    if value != []:
        raise bad_request(f"'{legacy}' (OpenAI's deprecated form of '{now}') is not supported; send '{now}'.",
                          legacy, "unsupported_parameter")


TEMPLATE_FIELDS = (   # vLLM's
    Field("chat_template_kwargs", "object", "Variables for the model's chat template (vLLM's), e.g. "
          '{"enable_thinking": false} for Qwen3.', parse=_template_kwargs),
    Field("add_generation_prompt", "boolean", "Open the assistant's turn after the messages (vLLM's).", True),
    Field("continue_final_message", "boolean", "Continue the last (assistant) message instead of opening a "
          "new turn (vLLM's; needs add_generation_prompt false).", False),
)
CHAT_FIELDS = (
    MODEL, MESSAGES, *TOOL_FIELDS, *TEMPLATE_FIELDS,
    Field("functions", None, "Not supported (OpenAI's deprecated form of tools): a non-empty list is a 400.",
          parse=lambda value: _deprecated("functions", "tools", value),
          schema={"type": ["array", "null"], "maxItems": 0}),
    Field("function_call", None, "Not supported (OpenAI's deprecated form of tool_choice): a value is a 400.",
          parse=lambda value: _deprecated("function_call", "tool_choice", value), schema={"type": "null"}),
    Field("logprobs", "boolean", "Return each token's log probability.", False),
    Field("top_logprobs", "integer", "Alternatives per token (needs logprobs).", low=0, high=MAX_LOGPROBS),
    Field("max_completion_tokens", "integer", "max_tokens under its newer name (wins over it).", low=1),
    Field("include_reasoning", "boolean", "A reasoning model's reasoning in `reasoning` and `reasoning_content` "
                                          "(vLLM's field); false leaves it out.", True),
    MAX_TOKENS, *SAMPLING, *SERVING, *STREAMING,
)
COMPLETION_FIELDS = (
    MODEL, PROMPT,
    Field("logprobs", "integer", "Alternatives per token; each token's log probability with them.",
          low=0, high=MAX_LOGPROBS),
    Field("echo", "boolean", "Put the prompt before the reply.", False),
    Field("suffix", "string", "Not supported: any non-empty suffix is refused."),
    MAX_TOKENS, *SAMPLING, *SERVING,
    Field("best_of", "integer", "Only best_of = n is supported.", low=1),
    *STREAMING,
)
# Each JSON route's fields, which its parser reads and /openapi.json documents.
# vLLM's bodies for LoRA adapters loaded at run time (server/adapters.py).
LOAD_LORA_FIELDS = (
    Field("lora_name", "string", "The name requests then give as `model`.", required=True),
    Field("lora_path", "string", "A PEFT LoRA adapter directory on the server, or a hub id (owner/name).",
          required=True),
    Field("model", "string", "The base model it adapts, on a server with several (default: the first)."),
    Field("load_inplace", "boolean", "Replace the weights of the adapter already loaded under lora_name "
                                     "(vLLM's): refused with 409 while requests use it.", False),
)
UNLOAD_LORA_FIELDS = (Field("lora_name", "string", "The adapter to stop serving.", required=True),)

REQUEST_FIELDS: dict[str, tuple[Field, ...]] = {"/v1/chat/completions": CHAT_FIELDS,
                                               "/v1/completions": COMPLETION_FIELDS,
                                               "/v1/load_lora_adapter": LOAD_LORA_FIELDS,
                                               "/v1/unload_lora_adapter": UNLOAD_LORA_FIELDS}


# ---- chat ---------------------------------------------------------------------------
def parse_chat_request(body: Any, limits: RequestLimits = RequestLimits()) -> ChatRequest:
    values = read_fields(Fields(body), REQUEST_FIELDS["/v1/chat/completions"])
    tools = tool_request(values)
    logprobs, top = values["logprobs"], values["top_logprobs"]
    if top is not None and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
    name = "max_tokens" if values["max_completion_tokens"] is None else "max_completion_tokens"
    sampling = _sampling(values, name, (top or 0) if logprobs else None)
    _check_sequences(1, sampling.n, limits)
    if tools is not None and tools.choice.forced and sampling.structured is not None:
        raise bad_request(f"'tool_choice' {tools.choice.mode!r} and '{sampling.structured.param}' both "
                          "constrain the reply; give one.", "tool_choice", "invalid_value")
    return ChatRequest(values["model"], values["messages"], sampling, _streaming(values), tools, _options(values),
                       template_options(values), values["include_reasoning"])


def template_options(values: dict[str, Any]) -> TemplateOptions:
    """The template fields, checked together (the chat route's and /tokenize's)."""
    template = TemplateOptions(values["chat_template_kwargs"], values["add_generation_prompt"],
                               values["continue_final_message"])
    if template.continue_final_message and template.add_generation_prompt:
        raise bad_request("'continue_final_message' needs 'add_generation_prompt' set to false.",
                          "continue_final_message", "invalid_value")
    messages = values["messages"]
    if template.continue_final_message and messages and messages[-1]["role"] != "assistant":
        raise bad_request("'continue_final_message' needs the last message to be the assistant's.",
                          "continue_final_message", "invalid_value")
    return template


# ---- completions ----------------------------------------------------------------------
def parse_completion_request(body: Any, limits: RequestLimits = RequestLimits()) -> CompletionRequest:
    values = read_fields(Fields(body), REQUEST_FIELDS["/v1/completions"])
    prompts = values["prompt"]
    if len(prompts) > limits.max_prompts:
        raise bad_request(f"'prompt' holds {len(prompts)} prompts; this server takes at most {limits.max_prompts} "
                          "in one request.", "prompt", "invalid_value")
    logprobs = values["logprobs"]
    if values["echo"] and logprobs is not None:
        raise bad_request("'echo' together with 'logprobs' is not supported.", "echo", "unsupported_parameter")
    if values["suffix"]:
        raise bad_request("'suffix' is not supported.", "suffix", "unsupported_parameter")
    sampling = _sampling(values, "max_tokens", logprobs, default_max_tokens=COMPLETION_MAX_TOKENS)
    best_of = values["best_of"]
    if best_of is not None and best_of != sampling.n:
        raise bad_request("'best_of' other than 'n' is not supported.", "best_of", "unsupported_parameter")
    _check_sequences(len(prompts), sampling.n, limits)
    return CompletionRequest(values["model"], prompts, sampling, _streaming(values), values["echo"],
                             _options(values))


def _check_sequences(num_prompts: int, n: int, limits: RequestLimits) -> None:
    total = num_prompts * n
    if total > limits.max_sequences:
        asked = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise bad_request(f"This request asks for {total} sequences ({asked}); this server generates at most "
                          f"{limits.max_sequences} for one request.", "n" if n > 1 else "prompt", "invalid_value")


# ---- shared ---------------------------------------------------------------------------
def _sampling(values: dict[str, Any], max_tokens: str, logprobs: int | None,
              default_max_tokens: int | None = None) -> SamplingFields:
    """The sampling fields, with `max_tokens` the name of the field the limit comes from."""
    knobs = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "seed", "n", "stop", "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
             "skip_special_tokens")
    if values["prompt_logprobs"] is not None:
        raise bad_request("'prompt_logprobs' is not supported.", "prompt_logprobs", "unsupported_parameter")
    max_given = values[max_tokens]
    if max_given is not None and values["min_tokens"] > max_given:
        raise invalid_value("min_tokens", f"at most {max_tokens} ({max_given})", values["min_tokens"])
    return SamplingFields(
        max_tokens=values[max_tokens],
        default_max_tokens=default_max_tokens,
        max_tokens_param=max_tokens,
        top_k=0 if values["top_k"] == -1 else values["top_k"],   # vLLM spells "off" as -1
        logprobs=logprobs,
        logit_bias=values["logit_bias"] or (),
        structured=pick_structured(values),
        **{name: values[name] for name in knobs},
    )


def _options(values: dict[str, Any]) -> RequestOptions:
    return RequestOptions(cache_salt=values["cache_salt"] or None, priority=values["priority"],
                          user=values["user"] or None, session_id=values["session_id"] or None)


def _streaming(values: dict[str, Any]) -> StreamFields:
    stream = values["stream"]
    if values["stream_options"] is not None and not stream:   # OpenAI's 400
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                          "stream_options", "invalid_value")
    options = values["stream_options"] or {}
    return StreamFields(stream, options.get("include_usage", False) and stream)


__all__ = ["CHAT_FIELDS", "COMPLETION_FIELDS", "REQUEST_FIELDS", "ChatRequest", "CompletionRequest", "Prompt",
           "RequestLimits", "SamplingFields", "StreamFields", "TemplateOptions", "parse_chat_request",
           "parse_completion_request", "parse_prompts"]
