"""Structured output and logit_bias fields: OpenAI's `response_format` and
`logit_bias`, and vLLM's `structured_outputs` (with its older `guided_*` names),
parsed into the engine's GrammarSpec. Each malformed field is a 400 naming its param;
whether the grammar library can enforce a schema is checked later, with the model's
tokenizer (`check_grammar`)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ruvllm_cli.engine.grammar import GrammarError, GrammarSpec, map_subschemas
from ruvllm_cli.server.errors import ApiError, bad_request
from ruvllm_cli.server.fields import Fields, invalid_value
from ruvllm_cli.server.spec import Field

log = logging.getLogger("ruvllm.server")

MAX_LOGIT_BIAS = 300         # OpenAI's own cap on entries
# A token id as a logit_bias key. At most 19 digits: int() of a 5,000-digit key
# raises, and no vocabulary is that large.
TOKEN_KEY = re.compile(r"^-?[0-9]{1,19}$")
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# vLLM's `structured_outputs` keys, and the `guided_*` request fields it took before.
_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Structured:
    """What a request constrains its reply to, and where it said so (for errors)."""

    spec: GrammarSpec
    param: str
    strict: bool = True           # json_schema's `strict`; json_object and the rest count as strict
    json_repair: bool = False     # close a truncated JSON reply with json-repair ("ruvllm" extension)
    # What the grammar is made of, each part on its own (a forced call's tools' schemas):
    # the one the library refuses is named in the 400, not a line of the whole grammar.
    parts: tuple[tuple[str, GrammarSpec], ...] = ()
    # The server's own constraint, not the request's word (tool_choice "auto"'s calls):
    # one the library cannot compile is left out (the calls go free), not a 400.
    optional: bool = False
    # Any text is allowed until a call opens (Reasoning.plan's `free_text`).
    free_text: bool = False

    @property
    def repairable(self) -> bool:
        return self.json_repair and self.spec.kind in ("json_object", "json_schema") and not self.strict


def pick_structured(values: dict[str, Any]) -> Structured | None:
    """At most one of response_format (non-text), structured_outputs or guided_*,
    from the request's STRUCTURED_FIELDS values."""
    guided = [name for name in _GUIDED if values[name] is not None]
    if len(guided) > 1:
        raise bad_request(f"Give one of {', '.join(_GUIDED)}, not several.", guided[1], "invalid_value")
    given = [values["response_format"], values["structured_outputs"], *(values[name] for name in guided)]
    found = [s for s in given if s is not None]
    if len(found) > 1:
        raise bad_request("Give one of 'response_format', 'structured_outputs' or 'guided_*', not several.",
                          found[1].param, "invalid_value")
    if not found:
        return None
    structured = found[0]
    extension = values["ruvllm"] or {}
    return Structured(structured.spec, structured.param, structured.strict, extension.get("json_repair", False))


def _response_format(response_format: Fields) -> Structured | None:
    kind = response_format.body["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured(GrammarSpec.json_object(), "response_format", strict=False)
    json_schema = response_format.object("json_schema")
    if json_schema is None:
        raise bad_request("Missing required parameter: 'response_format.json_schema'.",
                          "response_format.json_schema", "missing_required_parameter")
    return Structured(grammar_spec("json_schema", json_schema.body["schema"], "response_format.json_schema.schema"),
                      "response_format", strict=json_schema.boolean("strict"))


def _structured_outputs(options: Fields) -> Structured | None:
    given = [key for key in (*_VLLM_KINDS, "json_object") if options.has(key)]
    if len(given) != 1:
        raise invalid_value("structured_outputs", "must hold exactly one of json, regex, choice, grammar, "
                            "json_object", sorted(options.body))
    key = given[0]
    param = f"structured_outputs.{key}"
    if key == "json_object":
        return Structured(GrammarSpec.json_object(), param, strict=False) if options.boolean(key) else None
    return Structured(grammar_spec(_VLLM_KINDS[key], options.raw(key), param), param)


def _guided(name: str) -> Callable[[Any], Structured]:
    def parse(value: Any) -> Structured:
        return Structured(grammar_spec(_VLLM_KINDS[_GUIDED[name]], value, name), name)

    return parse


def grammar_spec(kind: str, value: Any, param: str) -> GrammarSpec:
    """A GrammarSpec from a request value; a JSON schema may come as JSON text (vLLM)."""
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise invalid_value(param, "must be a JSON schema object or its JSON text", value[:80]) from error
    builders = {"json_schema": GrammarSpec.json_schema, "regex": GrammarSpec.regex,
                "choice": GrammarSpec.choice, "grammar": GrammarSpec.lark}
    try:
        return builders[kind](value)
    except GrammarError as error:
        raise ApiError.from_ruvllm(error, param) from error
    except (TypeError, ValueError, AttributeError) as error:
        raise invalid_value(param, f"is not a valid {kind.replace('_', ' ')}", str(value)[:80]) from error


def parse_logit_bias(bias: Fields) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}, at most 300 entries.
    Ids are checked against the vocabulary later (`check_token_ids`)."""
    if len(bias.body) > MAX_LOGIT_BIAS:
        raise invalid_value("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", f"{len(bias.body)} entries")
    entries: dict[int, float] = {}
    for key in bias.body:
        if not TOKEN_KEY.fullmatch(key):   # fullmatch: `$` alone lets a final newline through
            raise invalid_value("logit_bias", "keys must be token ids (integers as strings)", key[:40])
        if int(key) in entries:   # "65" and "065": one token, whose biases would add up past the cap
            raise invalid_value("logit_bias", "each token id at most once", key[:40])
        low, high = LOGIT_BIAS_RANGE
        entries[int(key)] = bias.number(key, 0.0, low=low, high=high)
    return tuple(entries.items())


def check_token_ids(param: str, ids: Iterable[int], vocab_size: int) -> None:
    """`logit_bias`'s or `stop_token_ids`' ids in the vocabulary; a 400 naming the first outside."""
    outside = next((token for token in ids if not 0 <= token < vocab_size), None)
    if outside is not None:
        raise invalid_value(param, f"token ids must be in [0, {vocab_size})", outside)


def check_grammar(structured: Structured | None, engine: Any) -> Structured | None:
    """Compile the grammar now (cached for the engine): a schema the library cannot
    enforce is a 400 naming it, never a silent unconstrained run; an optional one
    (the server's own) is left out instead, with a log line (the returned None)."""
    if structured is None:
        return None
    try:
        engine.grammar_compiler.validate(structured.spec)
    except GrammarError as error:
        if structured.optional:
            log.info("%s: not held to a grammar (%s)", structured.param, error.message)
            return None
        for label, part in structured.parts:
            try:
                engine.grammar_compiler.validate(part)
            except GrammarError as refused:
                raise bad_request(f"{label} cannot be enforced: {refused.message}", structured.param) from error
        # Named in the message too: Anthropic's error shape has no `param`.
        raise ApiError(error.http_status, f"'{structured.param}' cannot be enforced: {error.message}",
                       param=structured.param) from error
    return structured


def repair_spec(spec: GrammarSpec) -> GrammarSpec:
    """What a repaired reply must match: `spec`'s schema without the minima a cut reply
    falls short of (`required`, `minItems`, `minProperties`, `minLength`), everywhere;
    types, enums, patterns and bounds stay (json_object as it is)."""
    if spec.kind != "json_schema":
        return spec
    return GrammarSpec.json_schema(map_subschemas(json.loads(spec.source), _without_minima))


_MINIMA = ("required", "minItems", "minProperties", "minLength")   # what a cut reply falls short of


def _without_minima(schema: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in schema.items() if key not in _MINIMA}


def repair_truncated_json(choice: Any, streamed: bool = False, allowed: Callable[[str], bool] | None = None) -> str:
    """Close a JSON reply that `max_tokens` cut off (json-repair), written compactly as
    the grammar writes it, and return the text added. A stream takes the repair only
    where it continues what was already sent (it cannot take text back). A repair is
    kept only where `allowed` (the request's grammar) takes it: json-repair had made
    `["n"]` of an object and `{"n":""}` where the schema asks for an integer."""
    from ruvllm_cli.engine.request import FinishReason

    if choice.finish_reason is not FinishReason.LENGTH:
        return ""
    import json_repair

    repaired = json_repair.repair_json(choice.text, return_objects=True)
    if repaired == "" and choice.text.strip() not in ('""', ""):
        return ""   # nothing json-repair could make of it
    fixed = json.dumps(repaired, ensure_ascii=False, separators=(",", ":"))
    if fixed == choice.text or (streamed and not fixed.startswith(choice.text)):
        return ""
    if allowed is not None and not allowed(fixed):
        return ""
    added = fixed[len(choice.text):] if fixed.startswith(choice.text) else fixed
    choice.text, choice.repaired = fixed, True
    return added


def mark_repaired(body: dict[str, Any], choices: Any) -> dict[str, Any]:
    """Say in the response which choices json-repair closed (`ruvllm.json_repaired`)."""
    by_index = {c.index: c for c in choices}
    for entry in body.get("choices", []):
        choice = by_index.get(entry.get("index"))
        if choice is not None and choice.repaired:
            entry["ruvllm"] = {"json_repaired": True}
    return body


_SCHEMA_TEXT = {"type": ["object", "string"], "description": "A JSON schema, or its JSON text."}
_RESPONSE_FORMAT = (
    Field("type", "string", required=True, enum=("text", "json_object", "json_schema")),
    Field("json_schema", "object", "Needed by type json_schema.", properties=(
        Field("name", "string"),
        Field("schema", "object", "The JSON schema the reply must match.", required=True),
        Field("strict", "boolean", "false: json-repair may close a truncated reply (ruvllm.json_repair).",
              False))),
)
_CHOICES = {"type": "array", "minItems": 1, "items": {"type": "string"}}
_LARK = {"type": "string", "minLength": 1, "description": "A Lark grammar (rule `start`)."}
_REGEX = {"type": "string", "minLength": 1, "description": "A regular expression the whole reply matches."}
_STRUCTURED_OUTPUTS = {"type": "object", "minProperties": 1, "properties": {
    "json": _SCHEMA_TEXT, "regex": _REGEX, "choice": _CHOICES, "grammar": _LARK,
    "json_object": {"type": "boolean"}},
    "description": "vLLM's form: exactly one of json, regex, choice, grammar, json_object."}
_GUIDED_SCHEMAS = {"guided_json": _SCHEMA_TEXT, "guided_regex": _REGEX, "guided_choice": _CHOICES,
                   "guided_grammar": _LARK}

STRUCTURED_FIELDS = (
    Field("response_format", "object", "Constrain the reply to JSON, or to a JSON schema.",
          properties=_RESPONSE_FORMAT, parse=_response_format),
    Field("structured_outputs", "object", parse=_structured_outputs, schema=_STRUCTURED_OUTPUTS),
    *(Field(name, None, f"vLLM's older form of structured_outputs.{kind}.", parse=_guided(name),
            schema=_GUIDED_SCHEMAS[name]) for name, kind in _GUIDED.items()),
    Field("ruvllm", "object", "ruvllm's extensions.", properties=(
        Field("json_repair", "boolean", "Close a JSON reply that max_tokens cut off (non-strict schemas).",
              False),)),
)
_LOGIT_BIAS = {"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": TOKEN_KEY.pattern},
               "additionalProperties": {"type": "number", "minimum": LOGIT_BIAS_RANGE[0],
                                        "maximum": LOGIT_BIAS_RANGE[1]}}
LOGIT_BIAS = Field("logit_bias", "object", "Token id (as a string) -> bias added to its logit.",
                   parse=parse_logit_bias, schema=_LOGIT_BIAS)
