"""Constrained decoding on llguidance: JSON schema, regex, choice and Lark grammars.

The engine owns the step: each step it builds ONE int32 bitmask `[rows, ceil(V/32)]`
for all constrained rows (V = the logits width), asks each request's `GrammarMatcher`
to `fill_bitmask` its row, masks the logits with `apply_bitmask`, samples, and calls
`accept(token)`. Once `is_finished` is true the grammar allows nothing but EOS, so the
engine ends the request there with finish reason "stop" (no step spent on the EOS).

    compiler = GrammarCompiler(tokenizer, vocab_size=logits_width)
    compiler.validate(spec)                     # a 400 before admission, never a silent free run
    compiled = compiler.submit(spec).result()   # off the engine's thread; cached by spec
    matcher = compiled.matcher()                # one per sequence

Ids at or beyond the tokenizer's size (padding up to the logits width) are never
allowed. JSON is compiled without free whitespace (compact, like vLLM's
disable_any_whitespace), so a random-weight model cannot wander into endless spaces.

This module imports neither torch nor llguidance at import time: `GrammarSpec` is a
plain value that request parsing can build cheaply.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ruvllm_cli.errors import UsageError

if TYPE_CHECKING:
    import llguidance
    import torch
    from transformers import PreTrainedTokenizerFast

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
_KIND_LABELS = {"json_object": "JSON schema", "json_schema": "JSON schema", "regex": "regular expression",
                "choice": "choice list", "grammar": "Lark grammar"}
_JSON_OBJECT_SCHEMA = '{"type":"object"}'
# Compact JSON: no whitespace between tokens at all; "," and ":" are llguidance's defaults.
_JSON_OPTIONS = {"whitespace_flexible": False}
_MAX_MESSAGE = 240
_HINTS = {"regex": "patterns use Rust regex syntax: no look-around, no backreferences",
          "grammar": "see llguidance's Lark syntax (docs/syntax.md in guidance-ai/llguidance)"}


MAX_REPEAT = 10_000
_REPEAT = re.compile(r"(?<!\\)\{([\d\s,]+)\}")   # {n}, {n,}, {n,m}, {,m}

# What llguidance is given is checked against its limits first (a helper's pass): an
# integer bound below -2^63 made it crash the process (a segfault: the server gone),
# one above 2^63 - 1 was clamped (9223372036854775807 for a minimum of 1e19, which the
# schema forbids), a count past 2^32 - 1 said "regex parse error: decimal literal
# invalid"; a chain of about 2,500 $refs (or Lark rules nested 3,000 deep) overflowed
# its stack. So: bounds within +-2^63, counts within 2^32 - 1, at most MAX_NESTING
# $refs or Lark rules, and the compile on a thread with a stack of COMPILE_STACK
# (virtual memory: only the pages a deep grammar touches are used).
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
MAX_NESTING = 10_000
COMPILE_STACK = 256 * 2**20
_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_]\w*(\.\d+)?\s*:", re.MULTILINE)
_stack_lock = threading.Lock()


def check_schema_limits(schema: Any) -> None:
    """GrammarError for a JSON schema past llguidance's limits (above)."""
    refs = 0

    def visit(sub: dict[str, Any]) -> dict[str, Any]:
        nonlocal refs
        for key in _BOUNDS:
            value = sub.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= 2**63:
                raise GrammarError(f"'{key}' {value} is beyond the range JSON schema numbers may take here "
                                   "(-2^63 to 2^63 - 1)")
        for key in _COUNTS:
            value = sub.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 2**32 - 1:
                raise GrammarError(f"'{key}' {value} is over the limit of 4294967295")
        refs += "$ref" in sub
        return sub

    map_subschemas(schema, visit)
    if refs > MAX_NESTING:
        raise GrammarError(f"the JSON schema has {refs} $refs, over the limit of {MAX_NESTING}")


def on_big_stack(work: Callable[[], Any]) -> Any:
    """`work()` on a thread of its own with a COMPILE_STACK stack: llguidance recurses
    through a grammar's nesting on the caller's stack (8 MiB: a segfault past ~2,500)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as error:  # noqa: BLE001 - raised again in the caller
            box["error"] = error

    with _stack_lock:   # stack_size is global: only this thread is made with it
        previous = threading.stack_size(COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="grammar-compile-stack", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class GrammarError(UsageError):
    """A grammar the request asked for that llguidance cannot compile or enforce."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; `(kind, source)` is the cache key.

    `source` is canonical text: compact JSON for schemas, the pattern for a regex, a
    JSON list for choices, the Lark text for a grammar. Schema keys keep their order:
    llguidance emits properties in the order `properties` lists them, so two schemas
    that differ only in key order are different grammars.
    """

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        """Any JSON object."""
        return cls("json_object", _JSON_OBJECT_SCHEMA)

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> "GrammarSpec":
        """A JSON value valid against `schema` (a JSON Schema object), its objects
        closed where it does not say otherwise (`closed_objects`)."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
        check_schema_limits(schema)
        try:
            source = json.dumps(closed_objects(schema), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise GrammarError(f"the JSON schema is not plain JSON: {error}") from None
        return cls("json_schema", source)

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        """Text that matches `pattern` as a whole (Rust `regex` syntax: no look-around)."""
        pattern = _non_empty_text(pattern, "regular expression")
        counts = [int(n) for body in _REPEAT.findall(pattern) for n in re.findall(r"\d+", body)]
        if counts and max(counts) > MAX_REPEAT:
            # llguidance takes such a repeat, then refuses tokens its own mask allowed.
            raise GrammarError(f"invalid regular expression: a repeat count of {max(counts)} is over "
                               f"the limit of {MAX_REPEAT}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> "GrammarSpec":
        """Exactly one of `options`."""
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise GrammarError("choices must be a non-empty list of strings")
        if not all(isinstance(option, str) for option in options):
            raise GrammarError("choices must be a non-empty list of strings")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def lark(cls, text: str) -> "GrammarSpec":
        """Text in the language of a Lark grammar (llguidance's dialect, rule `start`)."""
        text = _non_empty_text(text, "Lark grammar")
        rules = len(_LARK_RULE.findall(text))
        if rules > MAX_NESTING:
            raise GrammarError(f"the Lark grammar has {rules} rules, over the limit of {MAX_NESTING}")
        return cls("grammar", text)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.source)


# In a JSON schema: keys whose values are JSON values, not schemas (kept as written),
# and keys whose values map names to schemas (the names are not schema keys).
_SCHEMA_VALUES = ("const", "enum", "default", "examples")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def map_subschemas(schema: Any, visit: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """`schema` rebuilt with `visit` applied to it and to every schema inside it (deepest
    first); JSON values (`const`, `enum`, ...) and the names under `properties` and the
    like are left as written."""
    if isinstance(schema, list):
        return [map_subschemas(item, visit) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebuilt: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_VALUES:
            rebuilt[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            rebuilt[key] = {name: map_subschemas(sub, visit) for name, sub in value.items()}
        else:
            rebuilt[key] = map_subschemas(value, visit)
    return visit(rebuilt)


# A node with these says itself what else it holds, or shares its properties with
# subschemas: it is left as written.
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
              "$ref", "if", "dependentSchemas")
# Subschemas whose closing would change what the schema means (a `not` of a closed
# object accepts more, a `contains` match fewer): not entered.
_NOT_ENTERED = ("not", "if", "contains")


def closed_objects(schema: Any, shares_properties: bool = False) -> Any:
    """`schema` with `"additionalProperties": false` on each object schema that lists
    `properties` and says nothing of other keys, as llama.cpp's (so Ollama's) and
    xgrammar's (vLLM's default) converters read it: where JSON Schema allows any other
    key there, a model fills it (a random-weight one at once, a real one now and then)
    with keys no client asked for, and a reply cut mid-key is no JSON. A schema that
    says `additionalProperties` (or `patternProperties`, ...) keeps its word; a member of
    `allOf` (or of `anyOf`/`oneOf` beside the node's own `properties`) is left open, as
    it holds only part of the object."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebuilt: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_VALUES or key in _NOT_ENTERED:
            rebuilt[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            rebuilt[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
            partial = key == "allOf" or "properties" in schema
            rebuilt[key] = [closed_objects(sub, shares_properties=partial) for sub in value]
        else:
            rebuilt[key] = closed_objects(value)
    if isinstance(rebuilt.get("properties"), dict) and not shares_properties \
            and not any(key in rebuilt for key in _OPEN_KEYS):
        rebuilt["additionalProperties"] = False
    return rebuilt


def _non_empty_text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"a {what} must be a non-empty string")
    return value


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text for `spec` (not yet checked)."""
    from llguidance import LLMatcher, grammar_from

    if spec.kind in ("json_object", "json_schema"):
        return LLMatcher.grammar_from_json_schema(spec.source, defaults=_JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        return grammar_from("choice", spec.source)
    return LLMatcher.grammar_from_lark(spec.source)


_TOKEN_IDS = re.compile(r"<\[(\^?)([0-9,-]+)\]>")  # Lark token-id sets: <[5]>, <[1,7-9]>, <[^3]>
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")
_GBNF_RULE = re.compile(r"^\s*[A-Za-z][\w-]*\s*::=", re.MULTILINE)
_LOCATION = re.compile(r"^at \d+\(\d+\): ")
_NOISE = re.compile(r" \(in regex\)|; following special tokens are available: .*")


def grammar_error(spec: GrammarSpec, message: str) -> GrammarError:
    """llguidance's (multi-line) complaint about `spec`, as one line a user can act on."""
    keys = _UNIMPLEMENTED.search(message)
    if keys and spec.kind in ("json_object", "json_schema"):
        names = json.loads(keys.group(1))
        plural = "s" if len(names) > 1 else ""
        return GrammarError(f"unsupported JSON schema keyword{plural} " + ", ".join(repr(n) for n in names),
                            hint="constrained decoding cannot enforce it; remove it from the schema")
    hint = _HINTS.get(spec.kind)
    if spec.kind == "grammar" and _GBNF_RULE.search(spec.source):
        # llama.cpp's (and so Ollama's) grammar format: users of it meet Lark's parse error
        hint = ("this looks like GBNF, llama.cpp's format (`rule ::= ...`), which is not read here; write it in "
                "llguidance's Lark syntax (`rule: ...`), or send a JSON schema")
    return GrammarError(f"invalid {_KIND_LABELS[spec.kind]}: {one_line(message, spec.kind != 'grammar')}", hint=hint)


def one_line(message: str, drop_location: bool = True) -> str:
    """First line plus llguidance's `error: ...` line, without the source excerpt."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "rejected by llguidance"
    text = lines[0]
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    if detail:
        text = f"{text} {detail[len('error:'):].strip()}"
    text = _NOISE.sub("", text)
    if drop_location:
        # Positions point into the Lark text wrapped around a regex or choice, not the user's.
        text = _LOCATION.sub("", text)
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE - 1] + "…"


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A checked grammar bound to one tokenizer; immutable and shared by requests.

    `_template` is a matcher that is never advanced: each sequence gets a deep copy
    (microseconds), which shares the built lexer and parser instead of rebuilding them.
    """

    spec: GrammarSpec
    grammar: str
    layout: "MaskLayout"
    _template: "llguidance.LLMatcher" = field(repr=False)

    @property
    def warnings(self) -> list[str]:
        return self._template.get_grammar_warnings()

    @property
    def names_token_ids(self) -> bool:
        """Lark can allow raw ids (`<[151000]>`), padding ids included."""
        return self.spec.kind == "grammar" and "<[" in self.spec.source

    def matcher(self) -> "GrammarMatcher":
        """A fresh matcher at the start of the grammar, for one sequence."""
        return GrammarMatcher(self._template.deep_copy(), self.layout, self.names_token_ids)


@dataclass(frozen=True)
class MaskLayout:
    """Which bitmask columns exist: `words` int32 words per row; ids from `pad_start`
    on are logits padding beyond the tokenizer; `eos_ids` end a reply."""

    words: int
    pad_start: int
    eos_ids: tuple[int, ...]


class GrammarMatcher:
    """One sequence's position in its grammar (mutable; not shared between threads).

    Stopping: after `accept`, `is_finished` means only EOS may follow, so the engine
    ends the reply with finish reason "stop". `eos_allowed` means the text so far is a
    complete match (EOS is in the mask), so a sampled EOS also ends it with "stop".
    A matcher that `failed` (a token it forbade was accepted) masks everything but EOS.
    """

    def __init__(self, matcher: "llguidance.LLMatcher", layout: MaskLayout, clear_padding: bool = False) -> None:
        self._matcher = matcher
        self._layout = layout
        self._clear_padding = clear_padding  # llguidance itself never allows padding otherwise
        self._foreign: int | None = None  # an accepted id outside the tokenizer

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, contiguous, CPU)."""
        import torch

        words = self._layout.words
        if bitmask.dim() != 2 or bitmask.shape[1] != words or not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"bitmask shape {tuple(bitmask.shape)} has no row {row} of {words} words")
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 CPU tensor")
        if self.failed:
            _allow_only(bitmask[row].numpy(), self._layout.eos_ids)
            return
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * words * 4, words * 4)
        if self._clear_padding:
            _clear_from(bitmask[row].numpy(), self._layout.pad_start)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar forbade it (then `failed`)."""
        if self.failed:
            return False
        if not 0 <= token_id < self._layout.pad_start:
            self._foreign = token_id
            return False
        return self._matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing but EOS."""
        return self._matcher.is_stopped() and not self.failed

    @property
    def eos_allowed(self) -> bool:
        """The output so far is a complete match: EOS may end it now."""
        return self._matcher.is_accepting() and not self.failed

    @property
    def failed(self) -> bool:
        return self._foreign is not None or self._matcher.is_error()

    @property
    def error(self) -> str:
        """Why the matcher `failed` (llguidance's first line), else ""."""
        if self._foreign is not None:
            return f"token id {self._foreign} is outside the tokenizer"
        return one_line(self._matcher.get_error(), drop_location=False) if self._matcher.is_error() else ""


# numpy views of one bitmask row: single-word edits cost ~1 us there, ~20 us as torch ops.

def _allow_only(row: Any, ids: Sequence[int]) -> None:
    words = row.view("uint32")
    words[:] = 0
    for token_id in ids:
        words[token_id // 32] |= 1 << (token_id % 32)


def _clear_from(row: Any, start: int) -> None:
    """Zero the bits of ids >= start."""
    words = row.view("uint32")
    word, bit = divmod(start, 32)
    if word >= len(words):
        return
    if bit:
        words[word] &= (1 << bit) - 1
        word += 1
    words[word:] = 0


@dataclass
class CompileStats:
    """Cache hits and fresh compiles since the compiler was made."""

    hits: int = 0
    misses: int = 0


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer and logits width, behind an LRU cache.

    Building the llguidance tokenizer costs 1-3 s for a 150k vocabulary: make one
    compiler per loaded model. Thread-safe; `submit` compiles on a small pool
    (llguidance releases the GIL while it builds, so the engine keeps stepping).
    `layout.words` is the bitmask width the engine allocates.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerFast", vocab_size: int, *, max_cached: int = 64,
                 max_workers: int = 1, eos_token_ids: Sequence[int] | None = None) -> None:
        if vocab_size < len(tokenizer):
            raise ValueError(f"logits width {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
        self._tokenizer = _llguidance_tokenizer(tokenizer, vocab_size, eos_token_ids)
        from ruvllm_cli.engine.stream_load import release_freed_memory

        release_freed_memory()   # the build's temporaries (the vocabulary's JSON, twice parsed)
        self.layout = MaskLayout((vocab_size + 31) // 32, len(tokenizer), tuple(self._tokenizer.eos_tokens))
        self.stats = CompileStats()
        self._max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._pending: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for `spec` (blocking); raises GrammarError."""
        with self._lock:
            hit = self._lookup(spec.key)
        if hit is not None:
            return hit
        compiled = self._build(spec)
        with self._lock:
            self.stats.misses += 1
            return self._remember(compiled)

    def submit(self, spec: GrammarSpec) -> "Future[CompiledGrammar]":
        """`compile` on the pool; a cached spec gives a done future, one in flight its future."""
        with self._lock:
            hit = self._lookup(spec.key)
            if hit is not None:
                done: Future[CompiledGrammar] = Future()
                done.set_result(hit)
                return done
            if spec.key not in self._pending:
                self._pending[spec.key] = self._pool.submit(self._compile_pending, spec)
            return self._pending[spec.key]

    def validate(self, spec: GrammarSpec) -> None:
        """Raise GrammarError now if llguidance rejects `spec` (compiling it warms the cache)."""
        self.compile(spec)

    def accepts_text(self, spec: GrammarSpec, text: str) -> bool:
        """Whether `text` is a whole reply `spec` allows (tokenized as llguidance does)."""
        matcher = self.compile(spec).matcher()
        if not all(matcher.accept(token) for token in self._tokenizer.tokenize_str(text)):
            return False
        return matcher.is_finished or matcher.eos_allowed

    def close(self) -> None:
        """Stop the pool: queued compiles are cancelled, a running one finishes."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "GrammarCompiler":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _compile_pending(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            return self.compile(spec)
        finally:
            with self._lock:
                self._pending.pop(spec.key, None)

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        return on_big_stack(lambda: self._build_here(spec))

    def _build_here(self, spec: GrammarSpec) -> CompiledGrammar:
        from llguidance import LLMatcher

        try:
            grammar = llguidance_grammar(spec)
        except ValueError as error:
            raise grammar_error(spec, str(error)) from None
        self._check_token_ids(spec)
        template = LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise grammar_error(spec, template.get_error())
        compiled = CompiledGrammar(spec, grammar, self.layout, template)
        self._check_first_mask(compiled)
        return compiled

    def _check_first_mask(self, compiled: CompiledGrammar) -> None:
        """A grammar llguidance takes but that allows no first token (a self-referencing
        $ref, a repeat past its limits) would only fail at the first step: refuse it now."""
        import torch

        bitmask = torch.zeros((1, self.layout.words), dtype=torch.int32)
        matcher = compiled.matcher()
        matcher.fill_bitmask(bitmask, 0)
        if matcher.failed or not bool(bitmask.any()):
            reason = matcher.error
            if not reason or re.fullmatch(r"[A-Za-z]+", reason):   # a Rust enum's name: NoExtensionBias
                reason = "it allows no output at all" + (f" (llguidance: {reason})" if reason else "")
            error = grammar_error(compiled.spec, f"the grammar cannot be used: {reason}")
            error.hint = error.hint or ("a $ref that refers only to itself, or a repeat past its limits, "
                                        "allows no output")
            raise error

    def _check_token_ids(self, spec: GrammarSpec) -> None:
        # Padding ids are real ids to llguidance; a grammar that needs one could only
        # produce an all-masked row, since fill_bitmask clears them.
        if spec.kind != "grammar":
            return
        for match in _TOKEN_IDS.finditer(spec.source):
            if match.group(1):
                continue  # `<[^...]>`, all ids but these: fill_bitmask drops the padding
            last = max((int(bound) for bound in re.split(r"[,-]", match.group(2)) if bound), default=0)
            if last >= self.layout.pad_start:
                raise GrammarError(f"invalid Lark grammar: {match.group(0)} names ids beyond the tokenizer's "
                                   f"{self.layout.pad_start} tokens")

    def _lookup(self, key: tuple[str, str]) -> CompiledGrammar | None:
        hit = self._cache.get(key)
        if hit is None:
            return None
        self.stats.hits += 1
        self._cache.move_to_end(key)
        return hit

    def _remember(self, compiled: CompiledGrammar) -> CompiledGrammar:
        # Two threads may have built the same spec: everyone keeps the first one stored.
        kept = self._cache.setdefault(compiled.spec.key, compiled)
        self._cache.move_to_end(kept.spec.key)
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return kept


def _llguidance_tokenizer(tokenizer: "PreTrainedTokenizerFast", vocab_size: int,
                          eos_token_ids: Sequence[int] | None) -> "llguidance.LLTokenizer":
    """llguidance's tokenizer from the `tokenizers` backend's JSON, as
    `llguidance.hf.from_tokenizer` builds it, for transformers' tokenizers and ruvllm's
    own (engine/tokenizer.py) alike: that function accepts only transformers' class."""
    import copy

    import llguidance

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs a fast (tokenizers-backed) tokenizer")
    if backend.padding is not None or backend.truncation is not None:
        # Off on a copy, as llguidance's own function does (a copy parses the whole
        # vocabulary again: 0.37 s at 150k tokens, so only where there is something to turn off).
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
    eos = list(eos_token_ids) if eos_token_ids is not None else tokenizer.eos_token_id
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


def apply_bitmask(logits: "torch.Tensor", bitmask: "torch.Tensor",
                  indices: Sequence[int] | None = None) -> None:
    """Set the logits of disallowed ids to -inf, in place.

    `logits` is [N, V] float on any device; `bitmask` is int32 [rows, words] (any
    device) with one row per masked logits row: `indices[i]` names the logits row of
    bitmask row i, and without `indices` rows == N. Bits beyond V are ignored; ids at
    or beyond 32*words are disallowed.
    """
    import torch

    rows = len(indices) if indices is not None else logits.shape[0]
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != rows:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} do not pair up")
    covered = min(logits.shape[1], 32 * bitmask.shape[1])
    bias = unpack_bias(bitmask.to(logits.device, non_blocking=True), logits.dtype)[:, :covered]
    if indices is None:
        logits[:, :covered].add_(bias)
        logits[:, covered:] = float("-inf")
        return
    index = torch.as_tensor(list(indices), dtype=torch.long, device=logits.device)
    logits[:, :covered].index_add_(0, index, bias)
    logits[:, covered:].index_fill_(0, index, float("-inf"))


def unpack_bias(bitmask: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """[rows, words] int32 -> [rows, 32*words] additive mask: 0 where a bit is set, else -inf.

    Column c is bit c%32 of word c//32. The words are read as little-endian bytes and
    each byte is looked up in a 256 x 8 table: on CPU this is ~5x faster than shifting
    out bits and `masked_fill` (which measured ~1 ms for one 152k-wide row).
    """
    import sys

    import torch

    assert sys.byteorder == "little"  # token t is then bit t%8 of byte t//8
    as_bytes = bitmask.contiguous().view(torch.uint8)
    table = _byte_table(dtype, bitmask.device)
    return table.index_select(0, as_bytes.flatten().int()).view(bitmask.shape[0], -1)


@functools.lru_cache(maxsize=None)
def _byte_table(dtype: "torch.dtype", device: "torch.device") -> "torch.Tensor":
    import torch

    bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)
