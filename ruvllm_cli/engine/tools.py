"""Function tools for chat: what a request offers, what it forces, and the grammar
that makes `tool_choice` "required" or a named function hold.

The call format is the model family's own (`tool_parsers`): the grammar writes the
same markers the parser reads back, so a forced reply is always a well-formed call
to an offered tool with arguments valid against its schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from ruvllm_cli.engine.grammar import GrammarSpec, check_schema_limits, closed_objects, map_subschemas
from ruvllm_cli.errors import UsageError

MAX_PARALLEL_CALLS = 5          # what the grammar allows when parallel calls are on
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's rule for function names


@dataclass(frozen=True)
class Tool:
    """One offered function: its name, description and JSON schema of arguments."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    description: str | None = None
    # OpenAI's `strict`: its arguments must follow the schema. They do wherever the
    # grammar holds calls (forced, or opened under auto); strict only decides what a
    # schema the grammar library cannot enforce is: a 400 (strict), or free arguments.
    strict: bool = False

    def __post_init__(self) -> None:
        if not TOOL_NAME.fullmatch(self.name):
            raise UsageError(f"tool name {self.name!r} must be 1-64 letters, digits, '_' or '-'")

    def for_template(self) -> dict[str, Any]:
        """The OpenAI shape chat templates expect (`tools` of apply_chat_template)."""
        # OpenAI's order (name, description, parameters), as clients send it: templates
        # that dump the dict (Llama 3.1's JSON block, Mistral's) show it to the model so.
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """`auto` (the model decides), `none`, `required`, or `function` (forced by name)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class ToolRequest:
    """The tools side of one chat request."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = ToolChoice()
    parallel: bool = True

    def __post_init__(self) -> None:
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise UsageError("tool names must be unique")
        if self.choice.mode == "function" and self.choice.name not in names:
            raise UsageError(f"tool_choice names {self.choice.name!r}, which is not among the tools")
        if self.choice.forced and not self.tools:
            raise UsageError(f"tool_choice {self.choice.mode!r} needs at least one tool")

    @property
    def active(self) -> bool:
        """The model may call tools in this reply."""
        return bool(self.tools) and self.choice.mode != "none"

    def template_tools(self, history_has_calls: bool) -> list[dict[str, Any]] | None:
        """Tools for the chat template: left out under `none`, unless the history
        holds calls the template renders against them."""
        if not self.tools or (self.choice.mode == "none" and not history_has_calls):
            return None
        return [t.for_template() for t in self.tools]

    @property
    def strict(self) -> bool:
        """An offered tool is strict: its schema must be enforceable (a 400 if not)."""
        return any(tool.strict for tool in self.offered())

    def offered(self) -> tuple[Tool, ...]:
        if self.choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return self.tools


# ---- the grammar of a forced reply ----------------------------------------------------
def call_schema(tools: Sequence[Tool], arguments_key: str) -> dict[str, Any]:
    """One call object: {"name": <one tool>, <arguments_key>: <that tool's schema>}.

    Each tool's schema sits under the wrapper's `$defs` (as `tool<i>`), its own `$ref`s
    rewritten to point inside it: a `#/$defs/...` (pydantic's nested models) or a
    recursive `#` resolves against the document root, which is now the wrapper."""
    for tool in tools:
        check_schema_limits(tool.parameters)
    definitions = {f"tool{index}": _rooted(closed_objects(t.parameters), f"#/$defs/tool{index}")
                   for index, t in enumerate(tools)}
    variants = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                 "properties": {"name": {"const": t.name}, arguments_key: {"$ref": f"#/$defs/tool{index}"}}}
                for index, t in enumerate(tools)]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "$defs": definitions, "x-guidance": {"whitespace_flexible": False}}


def _rooted(schema: Any, root: str) -> Any:
    """`schema` with every local `$ref` ("#", "#/...") moved under `root`."""
    def move(sub: dict[str, Any]) -> dict[str, Any]:
        ref = sub.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            return {**sub, "$ref": root + ref[1:]}
        return sub

    return map_subschemas(schema, move)


def marker(tokenizer: Any, text: str) -> str:
    """A marker in Lark: the token itself where the tokenizer has it as one added
    token (llguidance sees added tokens as special), else the literal text."""
    token_id = tokenizer.get_added_vocab().get(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


# Where a call opens with one marker token, under tool_choice "auto" the reply is free
# text until the model writes it, then calls held to the offered tools.
OPENING_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def forced_call_grammar(request: ToolRequest, parser_name: str, tokenizer: Any) -> GrammarSpec | None:
    """The Lark grammar of a reply made only of calls, in the parser's format; None
    when nothing is forced."""
    if not request.choice.forced:
        return None
    return GrammarSpec.lark("\n".join(["start: calls", *_call_rules(request, parser_name, tokenizer)]))


def auto_call_grammar(request: ToolRequest, parser_name: str, tokenizer: Any) -> GrammarSpec | None:
    """Under tool_choice "auto": any text (the model's answer, its reasoning) until the
    model writes the format's opening marker, then calls in the parser's format to the
    offered tools, arguments valid against their schemas, and nothing after them: what
    llama.cpp's server does with its lazy grammars, and what OpenAI's `strict` promises.
    None where a call does not open with one token (llama3_json's calls are JSON text,
    a tokenizer without the marker as an added token): calls stay free there."""
    if request.choice.mode != "auto" or not request.tools or parser_name not in OPENING_MARKERS:
        return None
    opening = tokenizer.get_added_vocab().get(OPENING_MARKERS[parser_name])
    if opening is None:
        return None
    rules = _call_rules(request, parser_name, tokenizer)
    return GrammarSpec.lark("\n".join(["start: text calls?", f"text: <[^{opening}]>*", *rules]))


@dataclass(frozen=True)
class CallGrammar:
    """The grammar a reply that may call tools follows (`call_grammar`)."""

    spec: GrammarSpec
    forced: bool   # calls only (a forced tool_choice), else text then calls (auto)


def call_grammar(request: ToolRequest, parser_name: str, tokenizer: Any, constrained: bool) -> CallGrammar | None:
    """A forced tool_choice's calls; under "auto", text then calls unless the reply has
    a constraint of its own (`constrained`: a response_format); None where the calls go
    free. The one choice both the server (prompts.tool_sampling) and the engine's chat
    call make."""
    forced = forced_call_grammar(request, parser_name, tokenizer)
    if forced is not None:
        return CallGrammar(forced, True)
    auto = None if constrained else auto_call_grammar(request, parser_name, tokenizer)
    return None if auto is None else CallGrammar(auto, False)


def _call_rules(request: ToolRequest, parser_name: str, tokenizer: Any) -> list[str]:
    """Lark rules of `calls`: one call or more (parallel calls on: up to
    MAX_PARALLEL_CALLS) to the offered tools, in the parser's format."""
    def calls(item: str, separator: str) -> str:
        more = f"({separator} {item}){{0,{MAX_PARALLEL_CALLS - 1}}}" if request.parallel else ""
        return f"{item} {more}".strip()

    tools = request.offered()
    if parser_name == "hermes":
        obj = json.dumps(call_schema(tools, "arguments"))
        call = f'{marker(tokenizer, "<tool_call>")} "\\n" obj "\\n" {marker(tokenizer, "</tool_call>")}'
        rules = [f'calls: {calls("call", json.dumps(chr(10)))}', f"call: {call}"]
    elif parser_name == "llama3_json":
        obj = json.dumps(call_schema(tools, "parameters"))
        rules = [f'calls: {calls("obj", json.dumps("; "))}']
    elif parser_name == "mistral":
        obj = json.dumps(call_schema(tools, "arguments"))
        rules = [f'calls: {marker(tokenizer, "[TOOL_CALLS]")} "[" {calls("obj", json.dumps(","))} "]"']
    else:
        raise UsageError(f"no tool-call grammar for the {parser_name!r} format")
    return [*rules, f"obj: %json {obj}"]
