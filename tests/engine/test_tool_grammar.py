"""Forced tool calls: the grammar of each family's format, walked at random, always
parses back into valid calls with that family's parser; the engine's chat call
returns the calls as data (issue 20)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from ruvllm_cli.engine.grammar import GrammarCompiler
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.engine.tool_parsers import get_parser
from ruvllm_cli.engine.tools import (MAX_PARALLEL_CALLS, Tool, ToolChoice, ToolRequest, auto_call_grammar,
                                     forced_call_grammar)
from ruvllm_cli.errors import UsageError

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 6}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = (Tool("get_weather", WEATHER), Tool("add", ADD))
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def tokenizer(engine_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine_model_dir)


def walk(compiled, tokenizer, seed: int, prefer: int | None = None) -> str:
    """Decode a random path through the grammar, each token drawn from the allowed ones
    (`prefer`, where allowed, a tenth of the time: a call's marker in free text)."""
    matcher, rng, out = compiled.matcher(), random.Random(seed), []
    words = compiled.layout.words
    bitmask = torch.empty((1, words), dtype=torch.int32)
    while not matcher.is_finished and len(out) < 600:
        bitmask.fill_(-1)
        matcher.fill_bitmask(bitmask, 0)
        row = bitmask[0].tolist()
        allowed = [t for t in range(32 * words) if (row[t // 32] >> (t % 32)) & 1]
        if matcher.eos_allowed and rng.random() < (0.05 if prefer is not None else 0.3):
            break
        token = prefer if prefer in allowed and rng.random() < 0.1 else rng.choice(allowed)
        assert matcher.accept(token)
        out.append(token)
    return tokenizer.decode(out, skip_special_tokens=False)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_grammar_parses_back_into_valid_calls(tokenizer, fmt, parallel):
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    request = ToolRequest(TOOLS, ToolChoice("required"), parallel)
    compiled = compiler.compile(forced_call_grammar(request, fmt, tokenizer))
    counts = set()
    for seed in range(12):
        text = walk(compiled, tokenizer, seed).replace("<|im_end|>", "").replace("<|endoftext|>", "")
        parsed = get_parser(fmt).parse(text)
        assert parsed.tool_calls and not parsed.content, text
        assert len(parsed.tool_calls) <= (MAX_PARALLEL_CALLS if parallel else 1)
        counts.add(len(parsed.tool_calls))
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if parallel:
        assert max(counts) > 1   # the grammar does allow several calls


def test_a_named_function_is_the_only_one_called(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    request = ToolRequest(TOOLS, ToolChoice("function", "add"))
    compiled = compiler.compile(forced_call_grammar(request, "hermes", tokenizer))
    for seed in range(6):
        calls = get_parser("hermes").parse(walk(compiled, tokenizer, seed)).tool_calls
        assert {c.name for c in calls} == {"add"}


def test_nothing_is_forced_under_auto_and_none(tokenizer):
    for mode in ("auto", "none"):
        assert forced_call_grammar(ToolRequest(TOOLS, ToolChoice(mode)), "hermes", tokenizer) is None


def with_mistral_marker(tokenizer):
    """The tiny tokenizer with Mistral's [TOOL_CALLS] as an added token, as Mistral's own has it."""
    import copy

    mistral = copy.deepcopy(tokenizer)
    mistral.add_tokens(["[TOOL_CALLS]"], special_tokens=True)
    return mistral


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_auto_grammar_is_text_then_valid_calls(tokenizer, fmt):
    """tool_choice auto: any text, and once the model opens a call, calls to offered
    tools with valid arguments, then the end (random walks: both kinds of reply)."""
    tokenizer = with_mistral_marker(tokenizer) if fmt == "mistral" else tokenizer
    marker = "<tool_call>" if fmt == "hermes" else "[TOOL_CALLS]"
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    compiled = compiler.compile(auto_call_grammar(ToolRequest(TOOLS), fmt, tokenizer))
    kinds = set()
    for seed in range(16):
        text = walk(compiled, tokenizer, seed, prefer=tokenizer.convert_tokens_to_ids(marker))
        parsed = get_parser(fmt).parse(text.replace("<|im_end|>", "").replace("<|endoftext|>", ""))
        kinds.add(bool(parsed.tool_calls))
        assert text.count(marker) == (1 if parsed.tool_calls and fmt == "mistral" else len(parsed.tool_calls))
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert kinds == {True, False}


def test_auto_grammar_holds_what_follows_the_marker(tokenizer):
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    spec = auto_call_grammar(ToolRequest(TOOLS, parallel=False), "hermes", tokenizer)
    call = '<tool_call>\n{"name":"add","arguments":{"a":1%s}}\n</tool_call>'
    assert compiler.accepts_text(spec, "Let me add.")
    assert compiler.accepts_text(spec, "Let me add.\n" + call % "")
    assert not compiler.accepts_text(spec, call % ',"b":2')        # an argument the schema has not
    assert not compiler.accepts_text(spec, call.replace("add", "sub") % "")   # a tool not offered
    assert not compiler.accepts_text(spec, call % "" + " and more text")     # nothing after the calls
    assert not compiler.accepts_text(spec, call % "" + "\n" + call % "")    # parallel calls off: one


def test_no_auto_grammar_where_a_call_does_not_open_with_one_token(tokenizer):
    request = ToolRequest(TOOLS)
    assert auto_call_grammar(request, "llama3_json", tokenizer) is None   # its calls are JSON text
    assert auto_call_grammar(request, "mistral", tokenizer) is None       # no [TOOL_CALLS] token here
    assert auto_call_grammar(ToolRequest(TOOLS, ToolChoice("none")), "hermes", tokenizer) is None
    assert auto_call_grammar(ToolRequest(TOOLS, ToolChoice("required")), "hermes", tokenizer) is None


@pytest.mark.parametrize("make, words", [
    (lambda: Tool("bad name"), "letters"),
    (lambda: ToolRequest((Tool("a"), Tool("a"))), "unique"),
    (lambda: ToolRequest(TOOLS, ToolChoice("function", "missing")), "not among"),
    (lambda: ToolRequest((), ToolChoice("required")), "at least one"),
])
def test_bad_tool_requests_raise_usage_errors(make, words):
    with pytest.raises(UsageError, match=words):
        make()


def test_engine_chat_returns_parsed_calls(make_engine):
    engine = make_engine()
    messages = [{"role": "user", "content": "weather?"}]
    tools = ToolRequest(TOOLS, ToolChoice("required"))
    reply = engine.chat(messages, SamplingParams(max_tokens=200, temperature=1.0, seed=3), tools=tools)
    assert reply.tool_calls and reply.content == ""
    for call in reply.tool_calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    plain = engine.chat(messages, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert plain.tool_calls == [] and plain.content == plain.completion.text


# pydantic's nested models ($defs), a recursive tree ("#"), the older "definitions"
NESTED = {"$defs": {"Unit": {"enum": ["c", "f"]}}, "type": "object", "additionalProperties": False,
          "required": ["unit"], "properties": {"unit": {"$ref": "#/$defs/Unit"}}}
TREE = {"type": "object", "additionalProperties": False, "required": ["v", "child"],
        "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                       "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
OLD = {"definitions": {"n": {"type": "integer", "minimum": 1, "maximum": 3}}, "type": "object",
       "additionalProperties": False, "required": ["n"], "properties": {"n": {"$ref": "#/definitions/n"}}}


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_tool_schemas_with_refs_keep_their_meaning(tokenizer, fmt):
    """Each tool's `$ref`s point into its own schema, not into the call wrapper's: a
    `#/$defs/...` had failed to compile (a 400 for pydantic_function_tool's nested
    models), and a recursive `#` had let a whole call object in as a child."""
    tools = (Tool("convert", NESTED), Tool("tree", TREE), Tool("old", OLD))
    schemas = {t.name: t.parameters for t in tools}
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    compiled = compiler.compile(forced_call_grammar(ToolRequest(tools, ToolChoice("required")), fmt, tokenizer))
    seen = set()
    for seed in range(16):
        text = walk(compiled, tokenizer, seed).replace("<|im_end|>", "").replace("<|endoftext|>", "")
        for call in get_parser(fmt).parse(text).tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
            seen.add(call.name)
    assert seen == set(schemas)


def test_tools_reach_the_template_in_openais_key_order():
    """name, description, parameters, as clients send them: templates that dump the dict
    (Llama 3.1's JSON block, Mistral's) had shown the model parameters first."""
    assert list(Tool("add", ADD, "adds").for_template()["function"]) == ["name", "description", "parameters"]
    assert list(Tool("add", ADD).for_template()["function"]) == ["name", "parameters"]
