"""`ruvllm serve`'s command line: checks before it listens, and the start-up banner."""

from __future__ import annotations

import json

import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ruvllm_cli.cli.context import AppContext
from ruvllm_cli.cli.serve import print_banner, server_config

REPO_ROOT = Path(__file__).resolve().parents[2]
Run = Callable[..., subprocess.CompletedProcess]
KEY = "s3cret-key-from-the-flag"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("model, lines", [
    ("/nonexistent", ["Error: no such file or directory: '/nonexistent'"]),
    ("qwen-0.5b", ["Error: qwen-0.5b is not downloaded", "Hint: run: ruvllm download qwen-0.5b"]),
])
def test_a_missing_model_fails_before_listening(ruvllm: Run, free_port: int, model: str,
                                                lines: list[str]) -> None:
    """Issue 23, item 3: no "Listening on ..." (nor a bound port) for a model that is not there."""
    result = ruvllm("serve", model, "--port", str(free_port), timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines() == lines


@pytest.mark.parametrize("content, error", [
    (b"\xff\xfe{", "cannot read {config}: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
    (b"[1, 2]", "{config} is not a JSON object"),
    (b"{broken", "cannot read {config}: Expecting property name enclosed in double quotes: line 1 column 2 "
                 "(char 1)"),
])
def test_a_broken_config_fails_before_listening(ruvllm: Run, free_port: int, tmp_path: Path, content: bytes,
                                                error: str) -> None:
    """Not "Listening on ..." and then a traceback's last line (a config.json not UTF-8 gave
    UnicodeDecodeError, a JSON list AttributeError), but the loader's own error first."""
    config = tmp_path / "config.json"
    config.write_bytes(content)
    result = ruvllm("serve", str(tmp_path), "--port", str(free_port), timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"Error: {error.format(config=config)}"]


@pytest.mark.parametrize("field, value, kind", [
    ("rms_norm_eps", "1e-06", "a number"),           # loaded, then a step's TypeError stopped the server
    ("tie_word_embeddings", "false", "true or false"),   # loaded, and a string is true: the head tied
    ("num_hidden_layers", "two", "an integer"),       # "ValueError: invalid literal for int()"
    ("eos_token_id", [2, "x"], "a token id or a list of them"),
])
def test_a_config_field_of_the_wrong_type_fails_before_listening(ruvllm: Run, free_port: int, tmp_path: Path,
                                                                field: str, value: object, kind: str) -> None:
    """A helper's pass: a number written as a string in config.json loaded, and the
    first requests failed with a TypeError, the second stopping the engine."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "vocab_size": 512, field: value}))
    result = ruvllm("serve", str(tmp_path), "--port", str(free_port), timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"Error: {config}: {field} must be {kind}, not {json.dumps(value)}",
        "Hint: the model's config.json is damaged or hand-edited: fix that field"]
    info = ruvllm("info", str(tmp_path))
    assert info.returncode == 1 and f"{field} must be {kind}" in info.stderr and "Traceback" not in info.stderr


def test_a_damaged_gguf_fails_before_listening(ruvllm: Run, free_port: int, tmp_path: Path) -> None:
    gguf = tmp_path / "model-Q8_0.gguf"
    gguf.write_bytes(b"GGUF\0\0\0\0")
    result = ruvllm("serve", str(gguf), "--port", str(free_port), timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == f"Error: {gguf} is not a valid GGUF file: it is 8 bytes, shorter " \
                                            "than a GGUF header"
    assert "Listening" not in result.stderr


def banner(options: dict, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv("COLUMNS", "400")
    print_banner(AppContext(no_color=True), "http://127.0.0.1:8080", "tiny · cpu", ["tiny"],
                 {"host": "127.0.0.1", **options})
    return capsys.readouterr().err.splitlines()


def test_banner_with_a_key_from_the_flag_says_to_export_it(capsys, monkeypatch) -> None:
    """Issue 23, item 4: the example's $RUVLLM_API_KEY is unset when the key came as a flag."""
    lines = banner({"api_key": KEY, "api_key_from_flag": True}, capsys, monkeypatch)
    assert "  Try:        export RUVLLM_API_KEY=<your --api-key>" in lines
    curl = lines[lines.index("  Try:        export RUVLLM_API_KEY=<your --api-key>") + 1]
    assert curl.startswith("              curl http://127.0.0.1:8080/v1/chat/completions")
    assert '-H "Authorization: Bearer $RUVLLM_API_KEY"' in curl
    assert KEY not in "\n".join(lines)


def test_banner_with_a_key_from_the_environment_uses_it(capsys, monkeypatch) -> None:
    lines = banner({"api_key": KEY, "api_key_from_flag": False}, capsys, monkeypatch)
    curl = next(line for line in lines if line.startswith("  Try:"))
    assert curl.startswith("  Try:        curl ") and '-H "Authorization: Bearer $RUVLLM_API_KEY"' in curl
    assert not any("export" in line for line in lines) and KEY not in "\n".join(lines)


def test_banner_without_a_key_has_no_authorization(capsys, monkeypatch) -> None:
    lines = banner({"api_key": None}, capsys, monkeypatch)
    curl = next(line for line in lines if line.startswith("  Try:"))
    assert "Authorization" not in curl and not any("export" in line for line in lines)


def test_banner_names_the_chat_page_unless_it_is_off(capsys, monkeypatch) -> None:
    lines = banner({"api_key": None, "no_web_ui": False}, capsys, monkeypatch)
    assert lines[1:3] == ["  OpenAI API  http://127.0.0.1:8080/v1   (model: tiny)",
                          "  Web chat    http://127.0.0.1:8080/"]
    lines = banner({"api_key": None, "no_web_ui": True}, capsys, monkeypatch)
    assert not any("Web chat" in line for line in lines)
    assert "  Ollama API  http://127.0.0.1:8080   (/api/chat, /api/generate, /api/tags: Ollama's clients as they " \
           "are)" in lines


def test_no_web_ui_reaches_the_server_config() -> None:
    options = {"cors_origins": None, "max_prompts_per_request": 16, "max_sequences_per_request": 16,
               "api_key": None, "max_queue": 64, "max_body_size": 1024, "max_tokens_default": 16,
               "tool_call_parser": "auto", "reasoning_parser": "none", "allow_runtime_lora": False,
               "generation_config": "auto"}
    assert server_config({**options, "no_web_ui": False}, verbose=False).web_ui
    assert not server_config({**options, "no_web_ui": True}, verbose=False).web_ui
    assert server_config({**options, "no_web_ui": False}, verbose=False).reasoning_parser == "none"
    assert server_config({**options, "no_web_ui": False}, verbose=False).model_sampling
    assert not server_config({**options, "no_web_ui": False, "generation_config": "ignore"},
                             verbose=False).model_sampling


def read_lines(stream, into: "queue.Queue[str]") -> None:
    for line in stream:
        into.put(line.rstrip("\n"))


def test_the_banner_example_works_as_printed(tiny_model_dir: Path, cli_env: dict[str, str], free_port: int,
                                             tmp_path: Path) -> None:
    """Start `serve --api-key KEY`, run the banner's export and curl lines in a shell
    (with the key typed where the banner says), and get a reply."""
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(tiny_model_dir), "--port", str(free_port),
               "-q", "none", "--device", "cpu", "--max-context", "128", "--kv-cache-memory", "4MiB",
               "--max-tokens-default", "4", "--served-model-name", "tiny", "--api-key", KEY]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env={**cli_env, "COLUMNS": "400"},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stderr, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while not any("Press Ctrl+C" in line for line in seen):
            assert process.poll() is None and time.monotonic() < deadline, seen
            try:
                seen.append(lines.get(timeout=1))
            except queue.Empty:
                continue
        start = next(i for i, line in enumerate(seen) if line.startswith("  Try:"))
        example = [re.sub(r"^  (Try:)?\s+", "", line) for line in seen[start:start + 2]]
        assert example[0] == "export RUVLLM_API_KEY=<your --api-key>"
        script = "\n".join([example[0].replace("<your --api-key>", KEY),
                            example[1] + " -s -w '\\n%{http_code}'"])
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin"})
        assert done.stdout.splitlines()[-1] == "200", done
        assert '"chat.completion"' in done.stdout
        # Ollama's model list gives the size and digest of the one model served too
        # (they were there only for models loaded on first use)
        import httpx

        [listed] = httpx.get(f"http://127.0.0.1:{free_port}/api/tags", timeout=30,
                             headers={"Authorization": f"Bearer {KEY}"}).json()["models"]
        assert listed["size"] > 0 and re.fullmatch(r"[0-9a-f]{64}", listed["digest"]), listed
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert KEY not in "\n".join(seen)


def test_swap_space_without_swap_preemption_is_refused(ruvllm: Run, free_port: int, tiny_model_dir) -> None:
    """--swap-space sizes a pool only --preemption-mode swap makes: it had been ignored."""
    result = ruvllm("serve", str(tiny_model_dir), "--swap-space", "2GiB", "--port", str(free_port), timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "Error: --swap-space sizes the pool of --preemption-mode swap"
