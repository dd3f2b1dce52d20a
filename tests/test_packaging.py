"""The package's own metadata, as setuptools builds it when scripts/setup installs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_METADATA = """
import sys, warnings
from setuptools import build_meta
warnings.simplefilter("always")
print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))
"""


def copy_project(tmp_path: Path) -> Path:
    """What a build reads: pyproject.toml, README.md and the package."""
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, project / name)
    shutil.copytree(REPO_ROOT / "ruvllm_cli", project / "ruvllm_cli",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return project


def test_metadata_builds_without_a_license_deprecation_warning(tmp_path: Path) -> None:
    """Issue 23, item 8: `license = { text = "MIT" }` printed setuptools' deprecation
    warning four times during setup; an SPDX expression is the current form."""
    project = copy_project(tmp_path)
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, "-c", BUILD_METADATA, str(tmp_path / "out")], cwd=project,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "license" not in done.stderr.lower(), done.stderr
    metadata = (tmp_path / "out" / done.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: MIT" in metadata.splitlines()


# One build per process: in one, setuptools writes the second build where the first went.
BUILD = """
import sys
from setuptools import build_meta
print(getattr(build_meta, sys.argv[1])(sys.argv[2]))
"""


def test_the_wheel_and_the_sdist_carry_the_chat_page_and_the_kernels_source(tmp_path: Path) -> None:
    """`ruvllm serve` reads the page's files from the installed package (server/web.py):
    without them it could not start; the C kernels are built from their installed source."""
    project = copy_project(tmp_path)
    built = []
    for kind in ("build_wheel", "build_sdist"):
        (tmp_path / kind).mkdir()
        done = subprocess.run([sys.executable, "-c", BUILD, kind, str(tmp_path / kind)], cwd=project,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        built.append(tmp_path / kind / done.stdout.split()[-1])
    wheel, sdist = built
    pages = sorted(p.name for p in (REPO_ROOT / "ruvllm_cli" / "server" / "web").iterdir())
    assert "index.html" in pages and "app.js" in pages
    pages = [f"server/web/{n}" for n in pages] + ["engine/kernels/half_gemm.c"]
    with zipfile.ZipFile(wheel) as archive:
        assert [n for n in pages if f"ruvllm_cli/{n}" not in archive.namelist()] == []
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        assert [n for n in pages if f"ruvllm_cli/{n}" not in names] == []
