"""`ruvllm chat --json-schema FILE` and `--json`: every reply is constrained JSON.

Piped, stdout is one JSON document; a bad file or a schema llguidance cannot enforce
is one `Error:` line before the model loads. The tiny model has random weights, so
only constrained decoding can make its replies valid.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

Run = Callable[..., subprocess.CompletedProcess[str]]

# Bounded, so that a reply always completes well inside --max-tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture
def person_file(tmp_path: Path) -> Path:
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON), encoding="utf-8")
    return path


def chat(ruvllm: Run, model: Path, *args: str, message: str = "Ada Lovelace, 36, admin\n") -> Any:
    return ruvllm("chat", str(model), "-q", "none", *args, input=message)


@pytest.mark.parametrize("seed", ["1", "7"])
def test_piped_reply_is_one_json_document_valid_against_the_schema(ruvllm: Run, tiny_model_dir: Path,
                                                                   person_file: Path, seed: str) -> None:
    result = chat(ruvllm, tiny_model_dir, "--json-schema", str(person_file), "-t", "1", "--seed", seed,
                  "--max-tokens", "200")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("}\n") and result.stdout.count("\n") == 1
    document = json.loads(result.stdout)
    jsonschema.validate(document, PERSON)
    assert "Error" not in result.stderr


def test_json_flag_gives_a_json_object(ruvllm: Run, tiny_model_dir: Path) -> None:
    result = chat(ruvllm, tiny_model_dir, "--json", "-t", "1", "--seed", "1", "--max-tokens", "400")
    assert result.returncode == 0, result.stderr
    assert isinstance(json.loads(result.stdout), dict)


def test_a_reply_cut_by_max_tokens_fails(ruvllm: Run, tiny_model_dir: Path, person_file: Path) -> None:
    result = chat(ruvllm, tiny_model_dir, "--json-schema", str(person_file), "--max-tokens", "3")
    assert result.returncode == 1
    assert result.stdout == ""   # never a partial JSON document for the reader of stdout
    assert any(line.startswith("The reply so far: {") for line in result.stderr.splitlines()), result.stderr
    assert result.stderr.splitlines()[-2:] == [
        "Error: the reply reached the 3-token limit before its JSON was complete", "Hint: raise --max-tokens"]


@pytest.mark.parametrize(("content", "expected"), [
    (None, "Error: --json-schema: no file at {path}"),
    ("{not json", "Error: --json-schema: {path} is not JSON: Expecting property name enclosed in double "
                  "quotes: line 1 column 2 (char 1)"),
    ("[1, 2]", "Error: --json-schema: {path} holds a JSON array, not a schema object"),
    ('"a string"', "Error: --json-schema: {path} holds a JSON string, not a schema object"),
])
def test_a_bad_schema_file_is_a_one_line_usage_error(ruvllm: Run, tiny_model_dir: Path, tmp_path: Path,
                                                     content: str | None, expected: str) -> None:
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    result = chat(ruvllm, tiny_model_dir, "--json-schema", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines()[0] == expected.format(path=path)
    assert "Loaded" not in result.stderr  # failed before the model loaded


def test_an_unsupported_keyword_fails_before_the_model_loads(ruvllm: Run, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    path = tmp_path / "not.json"
    path.write_text('{"type": "object", "not": {}}', encoding="utf-8")
    result = chat(ruvllm, tiny_model_dir, "--json-schema", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"Error: --json-schema {path}: unsupported JSON schema keyword 'not'",
        "Hint: constrained decoding cannot enforce it; remove it from the schema"]


def test_json_and_json_schema_together_are_refused(ruvllm: Run, tiny_model_dir: Path, person_file: Path) -> None:
    result = chat(ruvllm, tiny_model_dir, "--json", "--json-schema", str(person_file))
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "Error: --json and --json-schema cannot be used together"


def test_the_engine_check_after_loading_names_the_option() -> None:
    from ruvllm_cli.cli.chat import validate_structured
    from ruvllm_cli.engine.grammar import GrammarError, GrammarSpec

    class Compiler:
        def validate(self, spec: GrammarSpec) -> None:
            raise GrammarError("invalid JSON schema: something only the tokenizer shows", "a hint")

    class Engine:
        grammar_compiler = Compiler()

    with pytest.raises(GrammarError) as caught:
        validate_structured(Engine(), GrammarSpec.json_schema(PERSON))  # type: ignore[arg-type]
    assert caught.value.message == "--json-schema: invalid JSON schema: something only the tokenizer shows"
    assert caught.value.hint == "a hint" and caught.value.exit_code == 2
    with pytest.raises(GrammarError) as caught:   # the file named, as the check before the load names it
        validate_structured(Engine(), GrammarSpec.json_schema(PERSON), "person.json")  # type: ignore[arg-type]
    assert caught.value.message.startswith("--json-schema person.json: invalid JSON schema")


def test_the_session_constrains_every_reply_without_saving_it(template: Any) -> None:
    from ruvllm_cli.chat.session import ChatSession
    from ruvllm_cli.engine.grammar import GrammarSpec

    spec = GrammarSpec.json_schema(PERSON)
    session = ChatSession(template, 4096, structured=spec)
    assert session.sampling_params().structured == spec
    assert session.sampling_params().temperature == session.settings.temperature
    assert ChatSession(template, 4096).sampling_params().structured is None
    assert "structured" not in json.dumps(session.to_dict())


@pytest.mark.timeout(90)
def test_repl_replies_are_valid_json(spawn_chat: Callable[..., Any], person_file: Path, tmp_path: Path) -> None:
    child = spawn_chat("--json-schema", str(person_file), "-t", "1", "--seed", "3", "--max-tokens", "200")
    child.expect("Every reply is JSON valid against --json-schema")
    for message in ("Who wrote the first program?", "And who built the engine?"):
        child.expect("You>")
        child.sendline(message)
        child.expect(r"\d+ tokens? · TTFT")
    child.expect("You>")
    child.sendline(f"/save {tmp_path / 'chat.json'}")
    child.expect("Saved 4 messages to")
    saved = json.loads((tmp_path / "chat.json").read_text(encoding="utf-8"))
    replies = [m["content"] for m in saved["messages"] if m["role"] == "assistant"]
    assert len(replies) == 2
    for reply in replies:
        jsonschema.validate(json.loads(reply), PERSON)
    child.expect("You>")   # Ctrl+D typed before the prompt reads is lost in the pty's cooked mode
    child.sendeof()
    child.expect("Goodbye.")
