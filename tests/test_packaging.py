"""The package's own metadata, as setuptools builds it when scripts/setup installs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_METADATA = """
import sys, warnings
from setuptools import build_meta
warnings.simplefilter("always")
print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))
"""


def test_metadata_builds_without_a_license_deprecation_warning(tmp_path: Path) -> None:
    """Issue 23, item 8: `license = { text = "MIT" }` printed setuptools' deprecation
    warning four times during setup; an SPDX expression is the current form."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, project / name)
    shutil.copytree(REPO_ROOT / "ruvllm_cli", project / "ruvllm_cli",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, "-c", BUILD_METADATA, str(tmp_path / "out")], cwd=project,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "license" not in done.stderr.lower(), done.stderr
    metadata = (tmp_path / "out" / done.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: MIT" in metadata.splitlines()
