"""Shared fixtures: a fake hub for the whole session, tiny models, an isolated user
environment per test, and a helper that runs `python -m ruvllm_cli` in a subprocess.

Nothing reaches the real Hugging Face hub: before any test module can import
`huggingface_hub` (which reads these variables at import time), this module starts
the session's `FakeHub` and points `HF_ENDPOINT` at it, and points `HF_HOME` at a
session scratch directory so in-process clients never touch the user's cache.

Per test (autouse): `RUVLLM_CACHE_DIR`, `RUVLLM_CONFIG_DIR`, `RUVLLM_DATA_DIR` and
`HF_HOME` point at fresh temporary directories, and after the test the fake hub forgets injected
failures, tokens and its request log (repos added by tests stay for the session, so
give them unique names).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

if __name__ != "conftest":
    # pytest imports this file as `conftest`; importing it again under another name
    # (`from tests.conftest import ...`) would start a second fake hub and point
    # HF_ENDPOINT at it, away from the `fake_hub` fixture's. Use the fixtures.
    raise ImportError(f"tests/conftest.py imported as {__name__!r}: take its helpers through fixtures "
                      "(`cli_env`, `make_cli_env`), not by import")

from ruvllm_cli.testing.fake_hub import FakeHub  # noqa: E402
from ruvllm_cli.testing.tiny_model import cached_tiny_model  # noqa: E402

# A user's own token or offline switch must not leak into tests.
for _name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
              "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_CACHE", "HF_XET_CACHE", "HF_TOKEN_PATH",
              "RUVLLM_API_KEY", "RUVLLM_DATA_DIR"):
    os.environ.pop(_name, None)
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
# The session's tiny models are shared: no load may write caches (quantized weights, the
# checked tokenizer) into them, session-scoped fixtures included, which are built before
# `isolated_env` runs. Tests that want the caches turn them on for copies.
os.environ["RUVLLM_WEIGHT_CACHE"] = "0"
_SESSION_HF_HOME = tempfile.mkdtemp(prefix="ruvllm-tests-hf-home-")
os.environ["HF_HOME"] = _SESSION_HF_HOME
SESSION_HUB = FakeHub().start()
os.environ["HF_ENDPOINT"] = SESSION_HUB.url
if "huggingface_hub" in sys.modules:
    # Imported before us (by a plugin): it has already read the real hub's address.
    import huggingface_hub.constants as _hf_constants

    _hf_constants.ENDPOINT = SESSION_HUB.url
    _hf_constants.HUGGINGFACE_CO_URL_TEMPLATE = SESSION_HUB.url + "/{repo_id}/resolve/{revision}/{filename}"


def pytest_unconfigure(config: pytest.Config) -> None:
    SESSION_HUB.stop()
    shutil.rmtree(_SESSION_HF_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def fake_hub() -> FakeHub:
    """The session's running fake hub (its URL is in `HF_ENDPOINT`)."""
    return SESSION_HUB


@pytest.fixture(autouse=True)
def _reset_fake_hub() -> Iterator[None]:
    yield
    SESSION_HUB.reset()


@pytest.fixture(scope="session", autouse=True)
def _kernels_built() -> None:
    """ruvllm's C kernels built before any test runs: on a fresh machine the first load
    would build them and say so on stderr, in whichever test came first (the build
    itself is tested with a directory of its own, tests/engine/test_half.py)."""
    from ruvllm_cli.engine.kernels import LOADERS

    for loader in LOADERS:
        loader()


@pytest.fixture(scope="session")
def _tiny_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def make_tiny_model(_tiny_models_root: Path) -> Callable[..., Path]:
    """`make_tiny_model(**kwargs)`: `build_tiny_model` (or `bench=True`), built once per kwargs.

    The directories are shared by the whole session: copy one before changing it.
    """

    def make(**kwargs: Any) -> Path:
        return cached_tiny_model(_tiny_models_root, **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model: Callable[..., Path]) -> Path:
    """The default float32 tiny model (shared: copy it before changing it)."""
    return make_tiny_model()


@contextmanager
def _unwritable(directory: Path) -> Iterator[None]:
    if os.geteuid() != 0:
        directory.chmod(0o555)
        try:
            yield
        finally:
            directory.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
        pytest.skip("running as root on a file system without chattr +i: no directory root cannot write")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)


@pytest.fixture
def unwritable() -> Callable[[Path], Any]:
    """`with unwritable(directory):` nothing in it can be created, renamed or deleted meanwhile:
    mode 0o555 for a user, the immutable attribute for root, whom modes do not stop (the
    test skips on a file system without it)."""
    return _unwritable


@dataclass(frozen=True)
class IsolatedEnv:
    cache_dir: Path
    config_dir: Path
    hf_home: Path
    data_dir: Path


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> IsolatedEnv:
    """Fresh (not yet created) ruvllm cache, config and data dirs and HF_HOME for this test.

    In-process `huggingface_hub` has read `HF_HOME` at import: pass `cache_dir`
    explicitly there; subprocesses see these variables.
    """
    env = IsolatedEnv(tmp_path / "ruvllm-cache", tmp_path / "ruvllm-config", tmp_path / "hf-home",
                      tmp_path / "ruvllm-data")
    monkeypatch.setenv("RUVLLM_CACHE_DIR", str(env.cache_dir))
    monkeypatch.setenv("RUVLLM_CONFIG_DIR", str(env.config_dir))
    monkeypatch.setenv("RUVLLM_DATA_DIR", str(env.data_dir))
    monkeypatch.setenv("HF_HOME", str(env.hf_home))
    # The session's tiny models are shared: q8/q4k loads must not write weight caches
    # into them (tests/engine/test_weight_cache.py turns the cache on for its copies).
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", "0")
    return env


def cli_environment(**overrides: str) -> dict[str, str]:
    """The current environment for a `python -m ruvllm_cli` subprocess, with overrides."""
    env = dict(os.environ)
    env["HF_ENDPOINT"] = SESSION_HUB.url
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONIOENCODING"] = "utf-8"
    env.update(overrides)
    return env


@pytest.fixture(scope="session")
def make_cli_env() -> Callable[..., dict[str, str]]:
    """`cli_environment` for fixtures wider than a test (the per-test dirs are not set there)."""
    return cli_environment


@pytest.fixture
def cli_env(isolated_env: IsolatedEnv) -> dict[str, str]:
    """A dict env for CLI subprocesses: this test's isolated dirs and the fake hub."""
    return cli_environment()


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    input: str | None = None,  # noqa: A002 - mirrors subprocess.run
    timeout: float = 120,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m ruvllm_cli *args`, capturing stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "ruvllm_cli", *args],
        env=env if env is not None else cli_environment(),
        input=input,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
        cwd=cwd or REPO_ROOT,
    )


@pytest.fixture
def ruvllm(cli_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`ruvllm("list", "--json")` runs the CLI with `cli_env` unless `env=` is given."""

    def run(*args: str, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, env=env if env is not None else cli_env, **kwargs)

    return run
