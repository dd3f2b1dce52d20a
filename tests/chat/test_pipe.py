"""`echo ... | ruvllm chat MODEL`: one message in, the reply alone on stdout, exit 0."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

Run = Callable[..., subprocess.CompletedProcess[str]]


def test_piped_message_prints_only_the_reply(ruvllm: Run, tiny_model_dir: Path) -> None:
    result = ruvllm("chat", str(tiny_model_dir), "--max-tokens", "8", "-q", "none", input="hello\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n") and result.stdout.count("\n") >= 1
    for chrome in ("You>", "ruvllm chat", "tok/s", "TTFT", "Loaded", "Goodbye"):
        assert chrome not in result.stdout
    assert "Loaded" in result.stderr and "Error" not in result.stderr


def test_piped_greedy_reply_is_the_engines_greedy_generation(ruvllm: Run, tiny_model_dir: Path,
                                                             loaded_model: Any, template: Any) -> None:
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.sampling import SamplingParams
    from ruvllm_cli.quantization import Quantization

    message = "What is the weather like in Paris?\nAnswer briefly."
    ids = template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": message}], True)
    engine = LLMEngine(loaded_model, EngineConfig(device="cpu", quantization=Quantization.F32))
    [expected] = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))
    assert expected.token_ids

    result = ruvllm("chat", str(tiny_model_dir), "-q", "none", "-t", "0", "--max-tokens", "12",
                    "-s", "Be brief.", input=message + "\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"


def test_empty_stdin_is_a_usage_error(ruvllm: Run, tiny_model_dir: Path) -> None:
    result = ruvllm("chat", str(tiny_model_dir), "-q", "none", input="  \n")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines()[0] == "Error: no message on stdin"


def test_a_seed_torch_cannot_take_is_refused_before_loading(ruvllm: Run, tiny_model_dir: Path) -> None:
    """It was taken, and the reply failed with "Overflow when unpacking long long"."""
    result = ruvllm("chat", str(tiny_model_dir), "--seed", str(2**64), input="hi\n")
    assert result.returncode == 2 and "Loaded" not in result.stderr
    assert "Invalid value for '--seed'" in result.stderr


def test_max_tokens_beyond_the_context_is_refused_as_max_is(ruvllm: Run, tiny_model_dir: Path) -> None:
    """--max-tokens past the context was taken silently, where /max refuses it; then it
    was refused only after the model had loaded (a minute for a 7B model)."""
    result = ruvllm("chat", str(tiny_model_dir), "-q", "none", "--max-tokens", "5000", input="hi\n")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["Error: --max-tokens 5000 is beyond the model's 4096-token context",
                                          "Hint: a reply ends where the context does: give at most 4096"]


def test_max_tokens_beyond_a_short_model_context_is_refused_before_loading(ruvllm: Run, tmp_path: Path) -> None:
    from ruvllm_cli.testing.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "short", max_position_embeddings=256)
    result = ruvllm("chat", str(model), "-q", "none", "--max-tokens", "300", input="hi\n")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["Error: --max-tokens 300 is beyond the model's 256-token context",
                                          "Hint: a reply ends where the context does: give at most 256"]
    result = ruvllm("chat", str(model), "-q", "none", "--max-tokens", "256", input="hi\n")
    assert result.returncode == 0 and result.stdout.strip()


@pytest.mark.parametrize("encoding", ["utf-8", ""])   # stdin decoded strictly, or with surrogateescape
def test_stdin_that_is_not_utf8_is_a_usage_error(cli_env: dict[str, str], tiny_model_dir: Path,
                                                 encoding: str) -> None:
    import sys

    env = {**cli_env, "PYTHONIOENCODING": encoding, "LC_ALL": "C.UTF-8"}
    result = subprocess.run([sys.executable, "-m", "ruvllm_cli", "chat", str(tiny_model_dir), "-q", "none"],
                            input=b"caf\xe9 au lait\n", capture_output=True, env=env, timeout=120)
    assert result.returncode == 2
    assert result.stdout == b""
    assert result.stderr.decode().splitlines()[:2] == ["Error: stdin is not UTF-8 text: byte 0xe9",
                                                       "Hint: convert it first, e.g. iconv -f latin1 -t utf-8"]


def test_a_piped_reply_ends_without_a_warning_about_turns_to_come(ruvllm: Run, make_tiny_model: Any,
                                                                  template: Any) -> None:
    """One message, one reply: the warning that the oldest turns will be dropped (shown
    after a long reply in the REPL) had ended a piped reply too, where no turn follows."""
    from ruvllm_cli.chat.session import ChatSession, ChatSettings

    model = make_tiny_model(max_position_embeddings=128)   # the tiny model's tokenizer, a 128-token context
    result = ruvllm("chat", str(model), "-q", "none", "-t", "0", "--max-tokens", "60", input="hello there\n")
    assert result.returncode == 0, result.stderr
    # the same conversation in a session: the REPL would have warned after this reply
    session = ChatSession(template, 128, model="tiny", settings=ChatSettings(max_tokens=60))
    session.add_user("hello there")
    session.add_reply(result.stdout.removesuffix("\n"))
    assert session.context_warning() is not None
    assert "the conversation uses" not in result.stderr and "Warning" not in result.stderr
