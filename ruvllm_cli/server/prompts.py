"""From parsed requests to engine work: prompt token ids and one plan per sequence.

Runs in a worker thread (tokenizing a long prompt or rendering a template must not
stall the event loop)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from ruvllm_cli.engine.chat_template import render_chat as engine_render_chat
from ruvllm_cli.engine.grammar import GrammarSpec
from ruvllm_cli.engine.reasoning import Reasoning
from ruvllm_cli.engine.request import RequestOptions
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.engine.tools import ToolRequest, call_grammar
from ruvllm_cli.engine.tool_parsers import ToolParser
from ruvllm_cli.errors import UsageError
from ruvllm_cli.server.errors import ApiError, bad_request
from ruvllm_cli.server.fields import invalid_value
from ruvllm_cli.server.protocol import Prompt, SamplingFields, TemplateOptions
from ruvllm_cli.server.structured import Structured, check_grammar, check_token_ids


@dataclass(frozen=True)
class SequencePlan:
    """One engine request: choice `index` of the response, for prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    options: RequestOptions = RequestOptions()   # cache salt, LoRA adapter, priority, user, session
    reasoning: Reasoning | None = None           # a reasoning model's markers, split from the reply
    in_reasoning: bool = False                   # the prompt left the reply inside its reasoning block


def check_constraints(engine: Any, sampling: SamplingFields) -> SamplingFields:
    """What needs the model to check: logit_bias ids in its vocabulary, and a grammar
    the library can enforce (compiled here, off the event loop and the engine thread).
    The sampling to use: without an optional grammar the library refused."""
    # A tokenizer may hold more tokens than the model has logits (added tokens past the
    # config's vocab_size): such an id is no token the model can produce.
    known = min(len(engine.tokenizer), engine.vocab_size)
    check_token_ids("logit_bias", (token for token, _ in sampling.logit_bias), known)
    check_token_ids("stop_token_ids", sampling.stop_token_ids, known)
    structured = check_grammar(sampling.structured, engine)
    return sampling if structured is sampling.structured else replace(sampling, structured=structured)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                param: str = "messages", template: TemplateOptions = TemplateOptions()) -> list[int]:
    """The conversation through the model's chat template, ready for the assistant's turn;
    `param` names the field it came in (`messages`, or the Responses API's `input`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions instead.", param)
    try:
        return engine_render_chat(tokenizer, messages, tools, template.add_generation_prompt,
                                  template.continue_final_message, template.kwargs)
    except UsageError as error:   # jinja's raise_exception and friends: the messages' fault
        reason = error.message.removeprefix("the chat template rejected the messages: ")   # said once
        raise bad_request(f"'{param}' does not fit the model's chat template: {reason}", param) from error


def template_tools(tools: ToolRequest | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Tools for the template: under tool_choice "none" only when the history holds
    calls or results that the template renders against them."""
    if tools is None:
        return None
    history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    return tools.template_tools(history)


def tool_sampling(tokenizer: Any, tools: ToolRequest, parser: ToolParser, sampling: SamplingFields) -> SamplingFields:
    """Sampling for a reply that may call tools: markers that are special tokens reach
    the parser (other special tokens are still skipped), and the calls follow a
    grammar. A forced tool_choice makes the reply calls only, which `stop` strings
    would cut mid-call (a "\\n" left the markup as content and no call; a "}" invalid
    arguments under finish_reason "tool_calls"): they apply to text, and a forced reply
    has none, so they are left out, as OpenAI's stop never cuts a call. Under "auto"
    they apply to the text before the first call opens (`stop_fence`), and the reply
    is free until the model opens a call (`call_grammar`), unless a response_format
    holds it; a tool schema the library cannot enforce is a 400 where the tool is
    strict, else leaves the calls free."""
    sampling = replace(sampling, kept_special_tokens=parser.markers, stop_fence=parser.opening)
    try:
        grammar = call_grammar(tools, parser.name, tokenizer, constrained=sampling.structured is not None)
    except UsageError as error:
        raise bad_request(error.message, "tool_choice") from error
    if grammar is None:
        return sampling
    parts = tuple((f"the parameters schema of tool '{tool.name}'", GrammarSpec.json_schema(tool.parameters))
                  for tool in tools.offered())
    if grammar.forced:
        return replace(sampling, structured=Structured(grammar.spec, "tools", parts=parts), stop=())
    return replace(sampling, structured=Structured(grammar.spec, "tools", parts=parts, optional=not tools.strict,
                                                   free_text=True))


def reasoning_sampling(tokenizer: Any, reasoning: Reasoning, sampling: SamplingFields, prompt_ids: list[int],
                       continued: str | None = None) -> tuple[SamplingFields, bool]:
    """Sampling for a reasoning model's reply (its markers reach the splitter even where
    they are special tokens; a constraint lets it reason first: `Reasoning.plan`), and
    whether it starts inside its block."""
    structured = sampling.structured
    plan = reasoning.plan(tokenizer, prompt_ids, structured is not None, continued,
                          budgeted=sampling.thinking_budget is not None,
                          free_text=structured is not None and structured.free_text)
    return plan.sampling(sampling, reasoning), plan.inside


def tokenize_prompts(tokenizer: Any, prompts: Sequence[Prompt], vocab_size: int) -> list[list[int]]:
    """Completion prompts as token ids (strings the way the engine itself encodes them);
    ids given by the client are checked against the vocabulary here, before anything
    (echo's decode) reads them."""
    ids = []
    for i, prompt in enumerate(prompts):
        tokens = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise bad_request(f"Prompt {i} is empty.", "prompt")
        outside = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if outside is not None:
            raise bad_request(f"Prompt {i} has token id {outside}, outside the vocabulary [0, {vocab_size}).",
                              "prompt", "invalid_value")
        ids.append(tokens)
    return ids


def plan_sequences(prompt_ids: list[list[int]], sampling: SamplingFields, max_model_len: int,
                   param: str, options: RequestOptions = RequestOptions(), reasoning: Reasoning | None = None,
                   in_reasoning: bool = False) -> list[SequencePlan]:
    """`n` sequences per prompt, choice index prompt * n + copy; `max_tokens` defaults
    to what the context leaves (capped by the endpoint's default), and a prompt plus an
    explicit `max_tokens` beyond the context is a 400."""
    check_max_tokens(sampling, max_model_len)
    plans = []
    for prompt_index, ids in enumerate(prompt_ids):
        max_tokens = fit_max_tokens(len(ids), sampling.max_tokens, max_model_len, param)
        if sampling.max_tokens is None and sampling.default_max_tokens is not None:
            max_tokens = min(max_tokens, sampling.default_max_tokens)
        for copy in range(sampling.n):
            plans.append(SequencePlan(prompt_index * sampling.n + copy, prompt_index, ids,
                                      sampling.params(max_tokens, copy), options, reasoning, in_reasoning))
    return plans


def check_max_tokens(sampling: SamplingFields, max_model_len: int) -> None:
    """A `max_tokens` beyond the whole context fits no prompt: the error names it."""
    if sampling.max_tokens is not None and sampling.max_tokens > max_model_len:
        raise invalid_value(sampling.max_tokens_param, f"must leave room for the prompt in this model's context "
                                                       f"of {max_model_len} tokens", sampling.max_tokens)


def fit_max_tokens(prompt_len: int, requested: int | None, max_model_len: int, param: str) -> int:
    room = max_model_len - prompt_len
    if room >= 1 and (requested is None or requested <= room):
        return requested if requested is not None else room
    asked = prompt_len + (requested if requested is not None else 1)
    completion = f"{requested} in the completion" if requested is not None else "at least 1 to generate"
    raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                        f"{asked} tokens ({prompt_len} in the {param}, {completion}). Please reduce the length "
                        f"of the {param} or completion.", param=param, code="context_length_exceeded")
