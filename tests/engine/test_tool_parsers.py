"""Tool-call parsers: every case of one table parsed whole, and streamed cut at every
character, one character at a time and in random chunks, must give the same reply."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import pytest

from ruvllm_cli.engine.tool_parsers import (
    PARSERS, StreamDelta, StreamingToolParser, ToolCall, detect_parser, get_parser,
)
from ruvllm_cli.engine.tool_parsers.json_scan import Incomplete, Malformed, scan_value
from ruvllm_cli.errors import UsageError
from tests.engine.tool_parser_cases import CASES, Case

ID_FORMAT = {"mistral": re.compile(r"[A-Za-z0-9]{9}")}
DEFAULT_ID_FORMAT = re.compile(r"call_[A-Za-z0-9]{24}")
RANDOM_SEEDS = range(5)


@dataclass
class Streamed:
    """A stream's deltas put back together, checking OpenAI's shape on the way."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: StreamDelta) -> None:
        self.content += delta.content
        for fragment in delta.tool_calls:
            if fragment.index == len(self.calls):  # a new call: index, id, name and no arguments yet
                assert fragment.id and fragment.name and fragment.arguments == ""
                self.calls.append(ToolCall(fragment.id, fragment.name, ""))
                continue
            assert fragment.index < len(self.calls)  # indexes come in order 0, 1, 2, ...
            assert fragment.id is None and fragment.name is None and fragment.arguments
            call = self.calls[fragment.index]
            self.calls[fragment.index] = ToolCall(call.id, call.name, call.arguments + fragment.arguments)

    def result(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.content, tuple((call.name, call.arguments) for call in self.calls)


def stream(parser_name: str, chunks: list[str]) -> tuple[Streamed, StreamingToolParser]:
    parser = StreamingToolParser(get_parser(parser_name))
    streamed = Streamed()
    for chunk in chunks:
        streamed.add(parser.feed(chunk))
    streamed.add(parser.finish())
    assert parser.calls == streamed.calls  # ids included
    return streamed, parser


def chunkings(text: str):
    """The text in one piece, cut once at every character, one character at a time,
    and in random chunks of 1 to 8 characters."""
    yield "whole", [text]
    for cut in range(1, len(text)):
        yield f"cut at {cut}", [text[:cut], text[cut:]]
    yield "by character", list(text)
    for seed in RANDOM_SEEDS:
        rng, chunks, pos = random.Random(seed), [], 0
        while pos < len(text):
            size = rng.randint(1, 8)
            chunks.append(text[pos:pos + size])
            pos += size
        yield f"random seed {seed}", chunks


def expected_stream(case: Case) -> tuple[str, tuple[tuple[str, str], ...]]:
    return case.streamed if case.streamed is not None else (case.content, case.calls)


def check_ids(parser_name: str, ids: list[str], written: tuple[str, ...] = ()) -> None:
    id_format = ID_FORMAT.get(parser_name, DEFAULT_ID_FORMAT)
    for call_id in ids:
        assert call_id in written or id_format.fullmatch(call_id), call_id
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
def test_parse(case: Case) -> None:
    reply = get_parser(case.parser).parse(case.text)
    assert reply.content == case.content
    assert tuple((call.name, call.arguments) for call in reply.tool_calls) == case.calls
    for call in reply.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    ids = [call.id for call in reply.tool_calls]
    check_ids(case.parser, ids, case.ids)
    assert [call_id for call_id in ids if call_id in case.ids] == list(case.ids)


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
def test_stream_matches_parse_however_cut(case: Case) -> None:
    expected = expected_stream(case)
    for how, chunks in chunkings(case.text):
        streamed, _ = stream(case.parser, chunks)
        assert streamed.result() == expected, how
        check_ids(case.parser, [call.id for call in streamed.calls], case.ids)


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case.parser}-{case.id}")
def test_a_whole_reply_in_the_server_ends_as_its_stream(case: Case) -> None:
    """What a client gets does not depend on `stream`: a call cut off (or broken) after
    its name is a call in the whole reply too, not markup in its content."""
    from ruvllm_cli.server.bridge import Choice
    from ruvllm_cli.server.tool_output import ToolReplies

    choice = Choice(0, 0, case.text)
    ToolReplies(get_parser(case.parser)).settle(choice)
    assert (choice.text, tuple((c.name, c.arguments) for c in choice.tool_calls)) == expected_stream(case)
    check_ids(case.parser, [call.id for call in choice.tool_calls], case.ids)


def test_table_covers_every_parser() -> None:
    assert len(CASES) >= 30
    assert {case.parser for case in CASES} == set(PARSERS)


# What is sent before the reply ends.

def deltas(parser_name: str, chunks: list[str]) -> list[StreamDelta]:
    parser = StreamingToolParser(get_parser(parser_name))
    return [parser.feed(chunk) for chunk in chunks] + [parser.finish()]


def test_hermes_content_streams_and_a_partial_marker_waits() -> None:
    sent = deltas("hermes", ["Let me check.\n<tool_", 'call>\n{"name": "get_weather", ',
                             '"arguments": {"city": "Pa', 'ris"}}\n</tool_call>'])
    assert sent[0] == StreamDelta("Let me check.")
    assert sent[1].content == ""
    assert [(d.index, d.name, d.arguments) for d in sent[1].tool_calls] == [(0, "get_weather", "")]
    assert [d.arguments for d in sent[2].tool_calls] == ['{"city": "Pa']
    assert [d.arguments for d in sent[3].tool_calls] == ['ris"}']
    assert sent[4] == StreamDelta()


def test_two_calls_in_one_step_get_their_own_index_and_id() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    (delta, final) = deltas("hermes", [text])
    assert [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [
        (0, "a", ""), (0, None, "{}"), (1, "b", ""), (1, None, '{"x": 1}')]
    assert delta.tool_calls[0].id != delta.tool_calls[2].id
    assert final == StreamDelta()


def test_trailing_whitespace_waits_for_more_content() -> None:
    assert [d.content for d in deltas("hermes", ["  Hello \n", "World\n\n"])] == ["Hello", " \nWorld", ""]


def test_llama3_holds_the_start_until_it_is_decided() -> None:
    sent = deltas("llama3_json", [" <|python", "_tag|>", '{"name": "f", "parameters": {"a": ', "1}}"])
    assert sent[0] == sent[1] == StreamDelta()
    assert [(d.name, d.arguments) for d in sent[2].tool_calls] == [("f", ""), (None, '{"a": ')]
    assert [d.arguments for d in sent[3].tool_calls] == ["1}"]
    assert deltas("llama3_json", ["Paris ", "is"])[0] == StreamDelta("Paris")


def test_mistral_partial_marker_waits_then_turns_out_to_be_text() -> None:
    assert [d.content for d in deltas("mistral", ["Hi [TOOL", "S] x"])] == ["Hi", " [TOOLS] x", ""]


def test_mistral_keeps_a_model_id_the_stream_can_still_use() -> None:
    early = '[TOOL_CALLS][{"id": "a1B2c3D4e", "name": "f", "arguments": {}}]'
    late = '[TOOL_CALLS][{"name": "f", "arguments": {}, "id": "a1B2c3D4e"}]'
    assert stream("mistral", list(early))[0].calls[0].id == "a1B2c3D4e"
    # The first fragment carries the id, so one written after the arguments comes too late.
    late_id = stream("mistral", list(late))[0].calls[0].id
    assert late_id != "a1B2c3D4e" and re.fullmatch(r"[A-Za-z0-9]{9}", late_id)
    assert get_parser("mistral").parse(late).tool_calls[0].id == "a1B2c3D4e"


def test_calls_so_far_while_streaming() -> None:
    parser = StreamingToolParser(get_parser("hermes"))
    parser.feed('<tool_call>{"name": "f", "arguments": {"q": "ab')
    assert [(call.name, call.arguments) for call in parser.calls] == [("f", '{"q": "ab')]


# Any text, however cut: the stream never takes anything back and ends the same way.

FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool_", "\n", '{"name": "f", "arguments": ', '{"a": [1, {"b": "}"}]}',
               "}", '"', "{", "x", " ", '\\"', "<"],
    "llama3_json": ["<|python_tag|>", '{"name": "f", "parameters": ', '{"a": [1, {"b": "}"}]}', "}", ";", "{",
                    '"', "x", " ", "\n", '\\"', "<|"],
    "mistral": ["[TOOL_CALLS]", "[", "]", ", ", '{"name": "f", "arguments": ', '{"a": [1, {"b": "]"}]}', "}",
                "f[ARGS]", "[CALL_ID]abc", "{}", "x", " ", '"', "[TOOL"],
}


@pytest.mark.parametrize("parser_name", sorted(FRAGMENTS))
def test_random_text_streams_the_same_however_cut(parser_name: str) -> None:
    rng = random.Random(parser_name)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS[parser_name]) for _ in range(rng.randint(1, 12)))
        get_parser(parser_name).parse(text)  # never raises
        whole = stream(parser_name, [text])[0].result()
        for how, chunks in [("by character", list(text)), ("random", _random_chunks(rng, text))]:
            assert stream(parser_name, chunks)[0].result() == whole, (text, how)


def _random_chunks(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(3, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# Generated replies: random calls with awkward arguments, written the way each format writes them.

AWKWARD_STRINGS = ["", "Paris", 'say "hi"', "{not json}", "]}", "</tool_call>", "<tool_call>", "[TOOL_CALLS]", "[ARGS]",
                   "<|python_tag|>", "back\\slash", "tab\tnew\nline", "Zürich ☀️", '; {"name": "x"}']
PROSE = ["Sure", " the", " a < b", " [x]", " {y}", ".", "\n", " ", "<b>", " 3 > 2"]


def random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["str", "int", "float", "bool", "null"] + (["list", "dict"] * 2 if depth < 3 else []))
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {rng.choice(AWKWARD_STRINGS) + str(i): random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}
    return {"str": lambda: rng.choice(AWKWARD_STRINGS), "int": lambda: rng.randint(-10**6, 10**6),
            "float": lambda: rng.uniform(-1e3, 1e3), "bool": lambda: rng.random() < 0.5, "null": lambda: None}[kind]()


def random_calls(rng: random.Random) -> list[tuple[str, str]]:
    def arguments() -> str:
        value = {f"k{i}": random_json(rng) for i in range(rng.randint(0, 3))}
        separators = rng.choice([(", ", ": "), (",", ":")])
        return json.dumps(value, ensure_ascii=rng.random() < 0.5, separators=separators)
    return [(rng.choice(["get_weather", "f", "run.code", "x-y"]), arguments()) for _ in range(rng.randint(1, 3))]


def prose(rng: random.Random) -> str:
    return "".join(rng.choice(PROSE) for _ in range(rng.randint(0, 5)))


def write_reply(parser_name: str, rng: random.Random) -> tuple[str, str, list[tuple[str, str]]]:
    """A reply in the format, with the content and calls parse must find in it."""
    calls = random_calls(rng)
    objects = [json.dumps({"name": name})[:-1] + ', "arguments": ' + arguments + "}" for name, arguments in calls]
    before, after = prose(rng), prose(rng)
    if parser_name == "hermes":
        between = [prose(rng) for _ in calls]
        text = before + "".join(f"<tool_call>\n{obj}\n</tool_call>{gap}" for obj, gap in zip(objects, between))
        return text + after, (before + "".join(between) + after).strip(), calls
    if parser_name == "llama3_json":
        after = "\nDone" + after if rng.random() < 0.5 else ""
        return rng.choice(["", "<|python_tag|>"]) + "; ".join(objects) + after, after.strip(), calls
    if rng.random() < 0.5:
        return before + "[TOOL_CALLS][" + ", ".join(objects) + "]" + after, (before + after).strip(), calls
    named = "".join(f"[TOOL_CALLS]{name}[ARGS]{arguments}" for name, arguments in calls)
    return before + named + after, (before + after).strip(), calls


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
def test_generated_replies_parse_and_stream(parser_name: str) -> None:
    rng = random.Random(f"generated {parser_name}")
    for _ in range(60):
        text, content, calls = write_reply(parser_name, rng)
        expected = (content, tuple(calls))
        reply = get_parser(parser_name).parse(text)
        assert (reply.content, tuple((call.name, call.arguments) for call in reply.tool_calls)) == expected, text
        for chunks in (list(text), _random_chunks(rng, text)):
            assert stream(parser_name, chunks)[0].result() == expected, text


# The JSON scanner under all of it: exact about where text stops being JSON.

VALID_JSON = ['{"a": [1, -2.5e+3, 0, 0.5E-1, true, false, null, "x\\"\\u00e9\\n\\/"], "b": {}, "c": []}',
              '{"deep": ' + "[" * 40 + "]" * 40 + "}", '{ "s" : "}{][\\\\" , "n":{"m":[{"k":[]}]} }']
INVALID_JSON = ['{"a": 01}', '{"a": 1,}', '{"a": [1 2]}', '{"a": "\\x"}', '{"a": "line\nbreak"}', '{"a": 1.e5}',
                '{"a": trux}', '{"a" 1}', '{"a": NaN}', '{"a": -Infinity}', '{"a": "\\u12G4"}', "{'a': 1}", '{"a": -}']


def _reject(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def _scan(text: str) -> str | int:
    try:
        return scan_value(text, 0)
    except Incomplete:
        return "incomplete"
    except Malformed as bad:
        return f"malformed at {bad.pos}"


@pytest.mark.parametrize("text", VALID_JSON)
def test_every_prefix_of_valid_json_is_incomplete(text: str) -> None:
    json.loads(text)
    assert [_scan(text[:cut]) for cut in range(len(text))] == ["incomplete"] * len(text)
    assert _scan(text) == len(text)


@pytest.mark.parametrize("text", INVALID_JSON)
def test_invalid_json_is_malformed_at_its_first_bad_character(text: str) -> None:
    with pytest.raises(ValueError):
        json.loads(text, parse_constant=_reject)
    result = _scan(text)
    assert isinstance(result, str) and result.startswith("malformed at ")
    bad = int(result.rsplit(" ", 1)[1])
    assert all(_scan(text[:cut]) == "incomplete" for cut in range(bad + 1))


# Choosing a parser.

QWEN_TEMPLATE = ('{%- if tools %}For each function call, return a json object within <tool_call></tool_call> '
                 'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
LLAMA31_TEMPLATE = ('<|start_header_id|>ipython<|end_header_id|>\n\n{%- if builtin_tools is defined %}'
                    '{{- "<|python_tag|>" + tool_call.name }}{%- endif %}<|eot_id|>')
LLAMA32_TEMPLATE = ('{%- elif message.role == "tool" or message.role == "ipython" %}'
                    '{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}')
LLAMA30_TEMPLATE = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}<|eot_id|>"
MISTRAL_TEMPLATE = '{{- "[AVAILABLE_TOOLS] [" }}...{{- "[TOOL_CALLS] [" }}'
CHATML_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>"


@pytest.mark.parametrize(("template", "architecture", "expected"), [
    (QWEN_TEMPLATE, "Qwen2ForCausalLM", "hermes"),
    (QWEN_TEMPLATE, None, "hermes"),
    (LLAMA31_TEMPLATE, "LlamaForCausalLM", "llama3_json"),
    (LLAMA32_TEMPLATE, None, "llama3_json"),
    (LLAMA30_TEMPLATE, "LlamaForCausalLM", "llama3_json"),
    (LLAMA30_TEMPLATE, None, None),
    (MISTRAL_TEMPLATE, None, "mistral"),
    (CHATML_TEMPLATE, "Qwen2ForCausalLM", "hermes"),
    (None, "MistralForCausalLM", "mistral"),
    (None, "LlamaForCausalLM", None),
    (CHATML_TEMPLATE, "GPT2LMHeadModel", None),
    (None, None, None),
])
def test_detect_parser(template: str | None, architecture: str | None, expected: str | None) -> None:
    assert detect_parser(template, architecture) == expected


def test_get_parser() -> None:
    assert {name: get_parser(name).name for name in PARSERS} == {
        "hermes": "hermes", "llama3_json": "llama3_json", "mistral": "mistral"}
    with pytest.raises(UsageError) as raised:
        get_parser("qwen")
    assert raised.value.message == "unknown tool-call parser 'qwen'"
    assert raised.value.hint == "known parsers: hermes, llama3_json, mistral"
