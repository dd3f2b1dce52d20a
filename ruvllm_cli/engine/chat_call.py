"""The engine's chat call for Python callers: messages (and tools) in, a finished
reply out, with any tool calls parsed into data and a reasoning model's reasoning
apart from its answer."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

from ruvllm_cli.engine.chat_template import render_chat
from ruvllm_cli.engine.reasoning import model_reasoning, split_reasoning
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.engine.tool_parsers import ToolCall, ToolParser, detect_parser, get_parser
from ruvllm_cli.engine.tools import ToolRequest, call_grammar
from ruvllm_cli.errors import UsageError

if TYPE_CHECKING:
    from ruvllm_cli.engine.engine import Completion, LLMEngine


@dataclass
class ChatReply:
    """A finished chat reply: its text outside any calls, and the calls as data."""

    completion: "Completion"
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""   # a reasoning model's, before its answer


def chat(engine: "LLMEngine", messages: Sequence[dict[str, Any]], params: SamplingParams | None = None,
         tools: ToolRequest | None = None, tool_parser: str | None = None) -> ChatReply:
    params = params or SamplingParams()
    parser = model_tool_parser(engine, tool_parser) if tools is not None and tools.active else None
    grammar = None
    if parser is not None:
        assert tools is not None
        grammar = call_grammar(tools, parser.name, engine.tokenizer, constrained=params.structured is not None)
        if grammar is not None and not grammar.forced and not tools.strict:
            try:
                engine.grammar_compiler.validate(grammar.spec)
            except UsageError:
                grammar = None   # a schema the library cannot enforce: the calls go free (prompts.tool_sampling)
        params = replace(params, kept_special_tokens=parser.markers, stop_fence=parser.opening,
                         structured=grammar.spec if grammar is not None else params.structured,
                         # a forced reply is calls only (prompts.tool_sampling)
                         stop=() if grammar is not None and grammar.forced else params.stop)
    history = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    prompt = render_chat(engine.tokenizer, messages, tools.template_tools(history) if tools else None)
    reasoning, inside = model_reasoning(engine.tokenizer), False
    if reasoning is not None:
        plan = reasoning.plan(engine.tokenizer, prompt, params.structured is not None,
                              free_text=grammar is not None and not grammar.forced)
        params, inside = plan.sampling(params, reasoning), plan.inside
    [completion] = engine.generate([prompt], params)
    thought, text = "", completion.text
    if reasoning is not None:
        split = split_reasoning(reasoning.format, text, inside)
        thought, text = split.reasoning, split.content
    if parser is None:
        return ChatReply(completion, text, reasoning=thought)
    parsed = parser.parse(text)
    return ChatReply(completion, parsed.content, list(parsed.tool_calls), thought)


def model_tool_parser(engine: "LLMEngine", name: str | None = None) -> ToolParser:
    """The named parser, else the one the model's template or architecture implies."""
    if name is None:
        architectures = getattr(engine.loaded.model.config, "architectures", None) or [None]
        name = detect_parser(getattr(engine.tokenizer, "chat_template", None), architectures[0])
    if name is None:
        raise UsageError("this model's tool-call format is not known", "name a tool-call parser")
    return get_parser(name)
