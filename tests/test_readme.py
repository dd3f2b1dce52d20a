"""README.md's Quick start, run as written in a fresh clone (slow: it runs scripts/setup)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICK_START_PORT = 8080  # the port the Quick start serves on


def quick_start(readme: str) -> list[str]:
    """The ```bash blocks of the "## Quick start" section, in order."""
    section = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```bash\n(.*?)^```$", section, flags=re.M | re.S)


def test_quick_start_sets_up_then_runs_the_tiny_model_with_no_hub() -> None:
    """Issue 23, item 8: setup puts ruvllm on PATH, then a no-hub chat and serve."""
    setup, tiny = quick_start((REPO_ROOT / "README.md").read_text())
    assert setup.splitlines() == ["scripts/setup", "source .venv/bin/activate", "ruvllm --help"]
    assert tiny.startswith("python scripts/make_tiny_model.py --out models/tiny\n")
    assert "ruvllm chat models/tiny" in tiny and "ruvllm serve models/tiny" in tiny and "huggingface" not in tiny


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_quick_start_runs_verbatim_in_a_fresh_clone(tmp_path: Path) -> None:
    """Clone the committed tree, then run the Quick start's blocks as one bash script
    (set -e), from a shell with no virtual environment and no PYTHONPATH."""
    if not port_is_free(QUICK_START_PORT):
        pytest.skip(f"port {QUICK_START_PORT}, which the Quick start serves on, is in use")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO_ROOT), str(clone)], check=True, timeout=300)
    script = "set -euo pipefail\n" + "".join(quick_start((clone / "README.md").read_text()))
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("_RUVLLM")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    done = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=3300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Usage: ruvllm [OPTIONS] COMMAND [ARGS]..." in done.stdout
    assert '"object": "chat.completion"' in done.stdout and '"finish_reason": "length"' in done.stdout
    assert "setup: ok" in done.stderr and "Stopped." in done.stderr
    assert (clone / "models" / "tiny" / "config.json").is_file()
