"""Chat fixtures: the tiny model's tokenizer and loaded weights (once per session), a
chat template over them, and a spawner for the real REPL in a pseudo-terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def template(tokenizer: Any) -> Any:
    from ruvllm_cli.chat.session import ChatTemplate

    return ChatTemplate(tokenizer)


@pytest.fixture(scope="session")
def loaded_model(tiny_model_dir: Path) -> Any:
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.quantization import Quantization

    return load_model(tiny_model_dir, "cpu", Quantization.F32)


@pytest.fixture
def spawn_chat(tiny_model_dir: Path, tmp_path: Path, cli_env: dict[str, str]) -> Iterator[Callable[..., Any]]:
    """`spawn_chat(*extra_args)`: `python -m ruvllm_cli chat <tiny model> -q none
    --cache-dir <tmp>/chat-cache` in a 100x24 pseudo-terminal (TERM=xterm)."""
    import pexpect

    children: list[Any] = []

    def spawn(*args: str, timeout: float = 30) -> Any:
        env = {**cli_env, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "100", "LINES": "24"}
        env.pop("NO_COLOR", None)
        argv = ["-m", "ruvllm_cli", "chat", str(tiny_model_dir), "-q", "none",
                "--cache-dir", str(tmp_path / "chat-cache"), *args]
        child = pexpect.spawn(sys.executable, argv, cwd=str(tmp_path), env=env, encoding="utf-8",
                              codec_errors="replace", dimensions=(24, 100), timeout=timeout)
        children.append(child)
        return child

    yield spawn
    for child in children:
        if child.isalive():
            child.close(force=True)
