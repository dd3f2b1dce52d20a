"""`ruvllm serve`'s command line: checks before it listens."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
Run = Callable[..., subprocess.CompletedProcess]

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
