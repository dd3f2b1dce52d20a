"""Constrained decoding: random walks through each grammar's masks produce valid text;
padding ids are never allowed; apply_bitmask matches a per-token reference; compiles
are cached and can run off-thread; what llguidance rejects is a one-line GrammarError."""

from __future__ import annotations

import ast
import json
import random
import re
import threading

import jsonschema
import pytest
import torch

from ruvllm_cli.engine.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    apply_bitmask,
)
from ruvllm_cli.errors import UsageError

WIDE = 151_936  # the bench model's logits width: 512 tokenizer ids + padding
SHIFTS = torch.arange(32, dtype=torch.int32)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    with GrammarCompiler(tokenizer, WIDE) as wide:
        yield wide


@pytest.fixture(scope="module")
def exact(tokenizer):
    """Logits exactly as wide as the tokenizer (512 ids, 16 words)."""
    with GrammarCompiler(tokenizer, len(tokenizer)) as narrow:
        yield narrow


def allowed_ids(bitmask: torch.Tensor, upto: int) -> list[int]:
    bits = (bitmask[0, : (upto + 31) // 32].unsqueeze(-1) >> SHIFTS) & 1
    return [i for i in bits.flatten().nonzero().flatten().tolist() if i < upto]


def walk(compiled: CompiledGrammar, seed: int, prefer: frozenset[int] = frozenset(),
         max_tokens: int = 300) -> tuple[list[int], GrammarMatcher]:
    """Sample uniformly from the allowed ids (half the time from `prefer`, when one is
    allowed, so unbounded grammars close) until EOS, `is_finished` or max_tokens."""
    layout = compiled.layout
    rng = random.Random(seed)
    matcher = compiled.matcher()
    bitmask = torch.zeros(1, layout.words, dtype=torch.int32)
    tokens: list[int] = []
    while not matcher.is_finished and len(tokens) < max_tokens:
        matcher.fill_bitmask(bitmask, 0)
        assert not padding_allowed(bitmask, layout.pad_start)
        allowed = allowed_ids(bitmask, layout.pad_start)
        preferred = [t for t in allowed if t in prefer]
        token = rng.choice(preferred if preferred and rng.random() < 0.5 else allowed)
        if token in layout.eos_ids:
            assert matcher.eos_allowed
            break
        assert matcher.accept(token), tokens + [token]
        tokens.append(token)
    assert matcher.is_finished or matcher.eos_allowed, "the walk ran out of tokens"
    return tokens, matcher


def padding_allowed(bitmask: torch.Tensor, pad_start: int) -> bool:
    bits = (bitmask[0].unsqueeze(-1) >> SHIFTS) & 1
    return bool(bits.flatten()[pad_start:].any())


def closing_ids(tokenizer, chars: str) -> frozenset[int]:
    """Ids whose text is made only of `chars` (e.g. quotes and closing brackets)."""
    return frozenset(i for i in range(len(tokenizer))
                     if (text := tokenizer.decode([i])) and set(text) <= set(chars))


# ---- random walks -------------------------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "score": {"type": "number"},
        "nick": {"type": ["string", "null"], "maxLength": 4},
        "kind": {"const": "user"},
    },
    "required": ["name", "age", "ok", "kind"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_walks_validate(compiler, tokenizer, seed):
    tokens, _ = walk(compiler.compile(GrammarSpec.json_schema(PERSON)), seed, closing_ids(tokenizer, ',}'))
    text = tokenizer.decode(tokens)
    jsonschema.validate(json.loads(text), PERSON)
    assert " " not in text.replace(json.loads(text)["name"], "")  # compact: no free whitespace


@pytest.mark.parametrize("seed", range(6))
def test_json_object_walks_are_objects(compiler, tokenizer, seed):
    tokens, _ = walk(compiler.compile(GrammarSpec.json_object()), seed, closing_ids(tokenizer, '"]},:'))
    assert isinstance(json.loads(tokenizer.decode(tokens)), dict)


@pytest.mark.parametrize("pattern", [r"[a-z]{2,5}-[0-9]{1,3}", r"(cat|dog)s? [0-9]+",
                                     r"[A-Za-z0-9._]{1,8}@[a-z]{2,6}\.(com|org)"])
@pytest.mark.parametrize("seed", range(4))
def test_regex_walks_fullmatch(compiler, tokenizer, pattern, seed):
    tokens, _ = walk(compiler.compile(GrammarSpec.regex(pattern)), seed)
    assert re.fullmatch(pattern, tokenizer.decode(tokens))


CHOICES = ["no", "nope", "maybe later", "été", 'say "hi"\n']


@pytest.mark.parametrize("seed", range(8))
def test_choice_walks_pick_one_choice(compiler, tokenizer, seed):
    tokens, _ = walk(compiler.compile(GrammarSpec.choice(CHOICES)), seed)
    assert tokenizer.decode(tokens) in CHOICES


ARITHMETIC = """\
start: expr
expr: term (("+" | "*") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""


def evaluates_to_int(text: str) -> bool:
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Mult, ast.Constant)
    return all(isinstance(node, allowed) for node in ast.walk(tree)) and isinstance(eval(text), int)


@pytest.mark.parametrize("seed", range(6))
def test_lark_walks_parse(compiler, tokenizer, seed):
    tokens, _ = walk(compiler.compile(GrammarSpec.lark(ARITHMETIC)), seed, closing_ids(tokenizer, ")"))
    text = tokenizer.decode(tokens)
    assert re.fullmatch(r"[0-9+*()]+", text) and evaluates_to_int(text)


def test_walks_work_when_logits_are_exactly_the_tokenizer_wide(exact, tokenizer):
    assert exact.layout.words == 16 and exact.layout.pad_start == 512
    tokens, _ = walk(exact.compile(GrammarSpec.json_schema(PERSON)), 0, closing_ids(tokenizer, ',}'))
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), PERSON)


# ---- stopping, failure and padding ---------------------------------------------------


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def mask_of(matcher: GrammarMatcher, words: int) -> list[int]:
    bitmask = torch.full((2, words), -1, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    assert bitmask[0].eq(-1).all()  # other rows untouched
    return allowed_ids(bitmask[1:], 32 * words)


def test_a_finished_grammar_allows_only_eos(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec.regex("ab|abc")).matcher()
    assert all(matcher.accept(t) for t in ids(tokenizer, "ab"))
    assert matcher.eos_allowed and not matcher.is_finished
    assert mask_of(matcher, compiler.layout.words) == sorted([3, *ids(tokenizer, "c")])
    assert matcher.accept(ids(tokenizer, "c")[0])
    assert matcher.is_finished and mask_of(matcher, compiler.layout.words) == [3]  # <|im_end|>
    assert matcher.accept(3) and matcher.is_finished and not matcher.failed


def test_eos_ids_can_be_given(tokenizer):
    end_of_text = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    with GrammarCompiler(tokenizer, 512, eos_token_ids=[3, end_of_text]) as compiler:
        matcher = compiler.compile(GrammarSpec.regex("a")).matcher()
        matcher.accept(ids(tokenizer, "a")[0])
        assert compiler.layout.eos_ids == (3, end_of_text)
        assert mask_of(matcher, 16) == sorted([3, end_of_text])


def test_a_forbidden_token_fails_the_matcher_and_leaves_only_eos(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec.regex("[0-9]+")).matcher()
    assert not matcher.accept(ids(tokenizer, "x")[0])
    assert matcher.failed and not matcher.is_finished and not matcher.eos_allowed
    assert "\n" not in matcher.error and matcher.error
    assert mask_of(matcher, compiler.layout.words) == [3]
    assert not matcher.accept(ids(tokenizer, "1")[0])


@pytest.mark.parametrize("token_id", [512, 151_935, -1])
def test_ids_outside_the_tokenizer_are_refused(compiler, token_id):
    matcher = compiler.compile(GrammarSpec.json_object()).matcher()
    assert not matcher.accept(token_id)
    assert matcher.failed and matcher.error == f"token id {token_id} is outside the tokenizer"


def test_padding_ids_stay_masked_when_lark_allows_all_but_one(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec.lark("start: <[^3]>")).matcher()
    allowed = mask_of(matcher, compiler.layout.words)
    assert allowed == [i for i in range(512) if i != 3]


@pytest.mark.parametrize("text", ['start: "x" <[600]>', "start: <[1,5-151000]>"])
def test_lark_naming_padding_ids_is_rejected(compiler, text):
    with pytest.raises(GrammarError, match=r"names ids beyond the tokenizer's 512 tokens"):
        compiler.compile(GrammarSpec.lark(text))


def test_lark_may_name_real_token_ids(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec.lark('start: "a" <[3]>')).matcher()
    assert matcher.accept(ids(tokenizer, "a")[0])
    assert mask_of(matcher, compiler.layout.words) == [3]


def test_fill_bitmask_checks_the_buffer(compiler):
    matcher = compiler.compile(GrammarSpec.json_object()).matcher()
    with pytest.raises(ValueError, match="no row 1 of 4748 words"):
        matcher.fill_bitmask(torch.zeros(1, 4748, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="no row 0 of 4748 words"):
        matcher.fill_bitmask(torch.zeros(1, 16, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="contiguous int32 CPU"):
        matcher.fill_bitmask(torch.zeros(1, 4748, dtype=torch.int64), 0)


def test_json_properties_keep_the_schema_order(compiler, tokenizer):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    assert GrammarSpec.json_schema(schema).source == json.dumps(schema, separators=(",", ":"))
    compiled = compiler.compile(GrammarSpec.json_schema(schema))
    declared, alphabetical = compiled.matcher(), compiled.matcher()
    assert all(declared.accept(t) for t in ids(tokenizer, '{"zeta":1,"alpha":2}')) and declared.is_finished
    assert not all(alphabetical.accept(t) for t in ids(tokenizer, '{"alpha":2,"zeta":1}'))


# ---- apply_bitmask ------------------------------------------------------------------


def naive_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.shape[1]
    for i, row in enumerate(rows):
        values = bitmask[i].tolist()
        for token in range(logits.shape[1]):
            if token >= 32 * words or not (values[token // 32] >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize(("rows", "width", "words"), [(1, 32, 1), (3, 100, 4), (2, 150, 3), (4, 64, 2),
                                                      (5, 1000, 32), (1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_matches_a_per_token_reference(rows, width, words, dtype):
    generator = torch.Generator().manual_seed(rows * width + words)
    logits = torch.randn(rows, width, generator=generator).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    bitmask[0, 0] = -1  # all 32 bits, bit 31 (the sign) included
    expected = naive_apply(logits, bitmask, list(range(rows)))
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_apply_bitmask_on_chosen_rows():
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 90, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)
    expected = naive_apply(logits, bitmask, [4, 1])
    apply_bitmask(logits, bitmask, [4, 1])
    assert torch.equal(logits, expected)


def test_apply_bitmask_rejects_unpaired_shapes():
    with pytest.raises(ValueError, match="do not pair up"):
        apply_bitmask(torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32))


def test_a_filled_mask_applied_leaves_exactly_the_allowed_ids(compiler, tokenizer):
    matcher = compiler.compile(GrammarSpec.choice(["yes", "no"])).matcher()
    bitmask = torch.zeros(1, compiler.layout.words, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, WIDE)
    apply_bitmask(logits, bitmask)
    finite = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert finite == allowed_ids(bitmask, WIDE) and {tokenizer.decode([i])[0] for i in finite} <= {"y", "n"}


# ---- compiling: cache, threads, errors -------------------------------------------------


def test_a_repeated_spec_is_a_cache_hit(compiler):
    schema = {"type": "object", "properties": {"q": {"type": "integer"}}}
    first = compiler.compile(GrammarSpec.json_schema(schema))
    hits = compiler.stats.hits
    assert compiler.compile(GrammarSpec.json_schema(dict(schema))) is first
    assert compiler.stats.hits == hits + 1
    assert compiler.submit(GrammarSpec.json_schema(schema)).result(timeout=0) is first


def test_the_cache_evicts_the_least_recently_used(tokenizer):
    with GrammarCompiler(tokenizer, 512, max_cached=2) as compiler:
        a, b, c = (GrammarSpec.regex(p) for p in ("a", "b", "c"))
        first_a = compiler.compile(a)
        compiler.compile(b)
        compiler.compile(a)  # a is now the most recent
        compiler.compile(c)  # evicts b
        assert compiler.compile(a) is first_a
        assert compiler.stats.misses == 3
        compiler.compile(b)
        assert compiler.stats.misses == 4


def test_submit_compiles_off_the_callers_thread(tokenizer, monkeypatch):
    threads: list[str] = []
    with GrammarCompiler(tokenizer, 512) as compiler:
        build = compiler._build
        gate = threading.Event()

        def spy(spec):
            threads.append(threading.current_thread().name)
            gate.wait(10)
            return build(spec)

        monkeypatch.setattr(compiler, "_build", spy)
        spec = GrammarSpec.regex("[a-z]{3}")
        future = compiler.submit(spec)
        assert compiler.submit(spec) is future  # one compile in flight per spec
        gate.set()
        compiled = future.result(timeout=30)
        assert compiler.compile(spec) is compiled
    assert len(threads) == 1 and threads[0].startswith("grammar-compile")


def test_submit_reports_errors_through_the_future(compiler):
    future = compiler.submit(GrammarSpec.regex("a(b"))
    with pytest.raises(GrammarError, match="unclosed group"):
        future.result(timeout=30)


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
     "unsupported JSON schema keyword 'not'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "unsupported JSON schema keyword 'uniqueItems'"),
    ({"type": "array", "contains": {"type": "integer"}}, "unsupported JSON schema keyword 'contains'"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
     "unsupported JSON schema keywords 'if', 'then'"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}},
     "unsupported JSON schema keyword 'dependentRequired'"),
])
def test_unsupported_schema_keywords_are_named(compiler, schema, message):
    with pytest.raises(GrammarError) as caught:
        compiler.validate(GrammarSpec.json_schema(schema))
    assert caught.value.message == message
    assert caught.value.hint == "constrained decoding cannot enforce it; remove it from the schema"
    assert isinstance(caught.value, UsageError) and caught.value.http_status == 400


@pytest.mark.parametrize(("spec", "message"), [
    (GrammarSpec.regex("a(b"), 'invalid regular expression: invalid regex "a(b": regex parse error: unclosed group'),
    (GrammarSpec.regex("(?=a)b"), "invalid regular expression: invalid regex \"(?=a)b\": regex parse error: "
                                  "look-around, including look-ahead and look-behind, is not supported"),
    (GrammarSpec.json_schema({"type": "strin"}), "invalid JSON schema: Invalid type: strin"),
    (GrammarSpec.json_schema({"type": "integer", "minimum": 5, "maximum": 1}),
     "invalid JSON schema: Unsatisfiable schema: minimum (5) is greater than maximum (1)"),
    (GrammarSpec.json_schema({"$ref": "#/$defs/missing"}),
     "invalid JSON schema: Pointer '/$defs/missing' does not exist"),
    (GrammarSpec.lark("start: a"), 'invalid Lark grammar: at 1(8): unknown name: "a"'),
    (GrammarSpec.lark('start: "x" <|nope|>'), 'invalid Lark grammar: at 1(8): unknown special token: "<|nope|>"'),
])
def test_rejected_grammars_give_one_line(compiler, spec, message):
    with pytest.raises(GrammarError) as caught:
        compiler.validate(spec)
    assert caught.value.message == message


def test_a_gbnf_grammar_is_told_apart_from_lark(compiler):
    """A helper's pass: llama.cpp's (Ollama's) grammar format met Lark's parse error and
    a Lark hint, never saying GBNF is not read."""
    with pytest.raises(GrammarError) as caught:
        compiler.validate(GrammarSpec.lark('root ::= answer\nanswer ::= "yes" | "no"'))
    assert "looks like GBNF" in (caught.value.hint or "")
    with pytest.raises(GrammarError) as caught:
        compiler.validate(GrammarSpec.lark("start: a"))
    assert "GBNF" not in (caught.value.hint or "")


def test_a_schema_that_allows_nothing_says_so_in_words(compiler):
    with pytest.raises(GrammarError) as caught:
        compiler.validate(GrammarSpec.json_schema({"$ref": "#"}))   # was "...: NoExtensionBias" alone
    assert caught.value.message == ("invalid JSON schema: the grammar cannot be used: it allows no output at all "
                                    "(llguidance: NoExtensionBias)")
    assert caught.value.hint == "a $ref that refers only to itself, or a repeat past its limits, allows no output"


def test_regex_errors_hint_at_the_syntax(compiler):
    with pytest.raises(GrammarError) as caught:
        compiler.validate(GrammarSpec.regex(r"(a)\1"))
    assert caught.value.hint == "patterns use Rust regex syntax: no look-around, no backreferences"


@pytest.mark.parametrize(("make", "message"), [
    (lambda: GrammarSpec.choice([]), "choices must be a non-empty list of strings"),
    (lambda: GrammarSpec.choice("yes"), "choices must be a non-empty list of strings"),
    (lambda: GrammarSpec.choice(["a", 1]), "choices must be a non-empty list of strings"),
    (lambda: GrammarSpec.json_schema(["type"]), "a JSON schema must be an object, not list"),
    (lambda: GrammarSpec.json_schema({"x": float("nan")}), "the JSON schema is not plain JSON: "),
    (lambda: GrammarSpec.regex(""), "a regular expression must be a non-empty string"),
    (lambda: GrammarSpec.lark(None), "a Lark grammar must be a non-empty string"),
    (lambda: GrammarSpec("xml", "<a/>"), "unknown grammar kind 'xml'"),
])
def test_specs_check_their_arguments(make, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        make()


def test_specs_are_canonical_values():
    assert GrammarSpec.json_object() == GrammarSpec("json_object", '{"type":"object"}')
    assert GrammarSpec.json_schema({"type": "string"}).source == '{"type":"string"}'
    assert GrammarSpec.choice(("a", "b")) == GrammarSpec("choice", '["a", "b"]')
    assert GrammarSpec.lark("start: \"x\"").kind == "grammar"


def test_the_logits_cannot_be_narrower_than_the_tokenizer(tokenizer):
    with pytest.raises(ValueError, match="smaller than the tokenizer's 512 tokens"):
        GrammarCompiler(tokenizer, 500)


def test_a_tokenizer_with_padding_and_truncation_is_read_without_them_and_kept_as_it_was(tokenizer):
    """llguidance reads the backend's JSON: padding and truncation are turned off on a
    copy (only when set), never on the tokenizer the engine encodes with."""
    from copy import deepcopy

    from ruvllm_cli.engine.grammar import _llguidance_tokenizer

    padded = deepcopy(tokenizer)
    padded.backend_tokenizer.enable_padding(length=64)
    padded.backend_tokenizer.enable_truncation(max_length=8)
    built = _llguidance_tokenizer(padded, WIDE, None)
    assert padded.backend_tokenizer.padding is not None and padded.backend_tokenizer.truncation is not None
    text = "a long enough text to be truncated at eight tokens, padded to sixty-four"
    assert built.tokenize_str(text) == tokenizer.encode(text)
    assert len(built.tokenize_str(text)) > 8


# ---- objects closed where the schema does not say otherwise ---------------------------
ITEM = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("schema, closed", [
    (ITEM, {**ITEM, "additionalProperties": False}),
    # nested, under $defs, in items and in anyOf alternatives
    ({"type": "object", "properties": {"x": ITEM, "y": {"type": "array", "items": ITEM}},
      "$defs": {"D": ITEM}, "required": []},
     {"type": "object", "properties": {"x": {**ITEM, "additionalProperties": False},
                                       "y": {"type": "array", "items": {**ITEM, "additionalProperties": False}}},
      "$defs": {"D": {**ITEM, "additionalProperties": False}}, "required": [], "additionalProperties": False}),
    ({"anyOf": [ITEM, {"type": "string"}]}, {"anyOf": [{**ITEM, "additionalProperties": False}, {"type": "string"}]}),
    # what the schema says itself stays
    ({**ITEM, "additionalProperties": True}, {**ITEM, "additionalProperties": True}),
    ({**ITEM, "additionalProperties": {"type": "string"}}, {**ITEM, "additionalProperties": {"type": "string"}}),
    ({**ITEM, "patternProperties": {"^x": {}}}, {**ITEM, "patternProperties": {"^x": {}}}),
    # a free object (no properties) stays free, as llama.cpp's converter reads it
    ({"type": "object"}, {"type": "object"}),
    # parts of one object: allOf members, anyOf beside the node's own properties
    ({"allOf": [ITEM, {"properties": {"b": {}}}]}, {"allOf": [ITEM, {"properties": {"b": {}}}]}),
    ({**ITEM, "anyOf": [{"properties": {"b": {}}}, {"required": ["a"]}]},
     {**ITEM, "anyOf": [{"properties": {"b": {}}}, {"required": ["a"]}]}),
    # subschemas whose closing would change the meaning; values that are not schemas
    ({"not": ITEM, "enum": [{"properties": 1}]}, {"not": ITEM, "enum": [{"properties": 1}]}),
])
def test_objects_are_closed_where_the_schema_says_nothing(schema, closed):
    from ruvllm_cli.engine.grammar import closed_objects

    assert closed_objects(schema) == closed


def test_a_schema_s_objects_take_no_keys_it_does_not_name(compiler):
    """Ollama (llama.cpp's converter) and vLLM (xgrammar's strict mode) close them: a
    model had filled the open object with invented keys (and run out of tokens in one)."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": ITEM}})
    assert compiler.accepts_text(spec, '{"a":1,"b":{"a":2}}')
    assert not compiler.accepts_text(spec, '{"a":1,"zz":2}')
    assert not compiler.accepts_text(spec, '{"b":{"a":2,"zz":2}}')
    open_spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                         "additionalProperties": True})
    assert compiler.accepts_text(open_spec, '{"a":1,"zz":2}')


def test_a_tool_s_arguments_are_closed_too(compiler, tokenizer):
    from ruvllm_cli.engine.tools import Tool, ToolChoice, ToolRequest, forced_call_grammar

    tools = ToolRequest((Tool("f", {"type": "object", "properties": {"city": {"type": "string"}}}),),
                        ToolChoice("required"), parallel=False)
    spec = forced_call_grammar(tools, "hermes", tokenizer)
    call = '<tool_call>\n{"name":"f","arguments":{"city":"x"%s}}\n</tool_call>'
    assert compiler.accepts_text(spec, call % "")
    assert not compiler.accepts_text(spec, call % ',"zz":1')


@pytest.mark.parametrize("schema, message", [
    ({"type": "integer", "minimum": -9223372036854775813, "maximum": -9223372036854775809},
     "'minimum' -9223372036854775813 is beyond"),            # llguidance had crashed the process
    ({"type": "integer", "minimum": 1e19, "maximum": 1.1e19}, "'minimum' 1e\\+19 is beyond"),   # clamped: invalid
    ({"type": "object", "properties": {"a": {"type": "number", "exclusiveMaximum": -2**63}}}, "'exclusiveMaximum'"),
    ({"type": "string", "maxLength": 10**12}, "'maxLength' 1000000000000 is over the limit"),
    ({"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(10_000)}, "$ref": "#/$defs/d0"},
     "10001 \\$refs, over the limit of 10000"),
])
def test_schemas_past_llguidance_s_limits_are_refused_before_it_sees_them(schema, message):
    with pytest.raises(GrammarError, match=message):
        GrammarSpec.json_schema(schema)


def test_a_deep_ref_chain_or_lark_nesting_compiles_on_a_deep_stack(compiler, tokenizer):
    """A chain of about 2,500 $refs (or Lark rules 3,000 deep) overflowed llguidance's
    stack on an 8 MiB thread: a segfault, the server gone. Compiled on a thread of its
    own with a 256 MiB stack (on_big_stack), 4,000 each compile and walk."""
    depth = 4_000
    chain = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)}, "$ref": "#/$defs/d0"}
    chain["$defs"][f"d{depth}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    tokens, _ = walk(compiler.compile(GrammarSpec.json_schema(chain)), seed=0)
    assert 0 <= json.loads(tokenizer.decode(tokens)) <= 9
    lark = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(depth)) + f'r{depth}: "ok"\n'
    tokens, _ = walk(compiler.compile(GrammarSpec.lark(lark)), seed=0)
    assert tokenizer.decode(tokens) == "ok"
