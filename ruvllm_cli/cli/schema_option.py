"""`--json-schema FILE` (chat and benchmark): read the schema, check what can be
checked before the model loads, and compile it for the loaded tokenizer after."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click

from ruvllm_cli.errors import UsageError

if TYPE_CHECKING:
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.grammar import GrammarSpec


@dataclass(frozen=True)
class SchemaFile:
    """A --json-schema FILE as given, and the grammar it asks for."""

    path: str
    spec: "GrammarSpec"


def json_schema_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--json-schema FILE, exposed as `json_schema`: a SchemaFile (or None), read and
    checked while the command line is parsed, so a bad file fails before any model loads."""
    return click.option("--json-schema", "json_schema", metavar="FILE", type=click.Path(dir_okay=False),
                        default=None, callback=_schema_option_callback, help=help_text)


def _schema_option_callback(ctx: click.Context, param: click.Parameter, value: str | None) -> SchemaFile | None:
    return None if value is None else SchemaFile(value, schema_spec(value))


def schema_spec(path: str) -> "GrammarSpec":
    """The JSON schema in the file at `path`, checked as far as it can be without a tokenizer."""
    from ruvllm_cli.engine.grammar import GrammarError, GrammarSpec

    try:
        spec = GrammarSpec.json_schema(read_schema_file(path))
        precheck_grammar(spec)
    except GrammarError as error:
        raise GrammarError(f"--json-schema {path}: {error.message}", error.hint) from None
    return spec


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_schema_file(path: str) -> dict[str, Any]:
    """The JSON object in `path`; UsageError (exit 2) for a missing, unreadable or non-JSON file."""
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--json-schema: no file at {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--json-schema: cannot read {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"--json-schema: {path} is not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema: {path} holds a JSON {_JSON_KINDS.get(type(schema), 'value')}, "
                         "not a schema object",
                         'a JSON schema is an object, e.g. {"type": "object", "properties": {...}}')
    return schema


def precheck_grammar(spec: "GrammarSpec") -> None:
    """llguidance's tokenizer-free check (well under 1 ms): an unsupported keyword fails
    here, before the model loads. The engine's compile after loading stays the final word."""
    from llguidance import LLMatcher

    from ruvllm_cli.engine.grammar import grammar_error, llguidance_grammar, on_big_stack

    try:
        failed, messages = on_big_stack(lambda: LLMatcher.validate_grammar_with_warnings(llguidance_grammar(spec)))
    except ValueError as error:
        failed, messages = True, [str(error)]
    if failed:
        raise grammar_error(spec, messages[0])


def validate_structured(engine: "LLMEngine", spec: "GrammarSpec", path: str | None = None) -> None:
    """Compile `spec` for the loaded tokenizer now (GrammarError, exit 2), not at the first
    reply; `path`: the --json-schema FILE, named as the check before the load names it."""
    from ruvllm_cli.engine.grammar import GrammarError

    try:
        engine.grammar_compiler.validate(spec)
    except GrammarError as error:
        option = "--json" if spec.kind == "json_object" else "--json-schema"
        raise GrammarError(f"{option}{f' {path}' if path else ''}: {error.message}", error.hint) from None
