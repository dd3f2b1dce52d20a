"""`ruvllm benchmark` as a subprocess, with the user's directories in a temporary home."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def bench(model: Path, *args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONIOENCODING="utf-8", NO_COLOR="1",
               RUVLLM_CACHE_DIR=str(home / "cache"), RUVLLM_CONFIG_DIR=str(home / "config"))
    return subprocess.run([sys.executable, "-m", "ruvllm_cli", "benchmark", str(model), *args],
                          env=env, capture_output=True, text=True, encoding="utf-8", timeout=120, cwd=home)
