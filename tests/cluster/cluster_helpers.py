"""Running `ruvllm serve` subprocesses for the cluster tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(root: Path, **extra: str) -> dict[str, str]:
    """This environment, with ruvllm's directories under `root` and the repository importable
    (by the server and by the Ray workers it starts, which inherit it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    for name in ("cache", "config", "data"):
        env[f"RUVLLM_{name.upper()}_DIR"] = str(root / name)
    env["HF_HOME"] = str(root / "hf-home")
    env["RUVLLM_WEIGHT_CACHE"] = "0"
    env.update(extra)
    return env


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited: {process.communicate()[1]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server never became healthy")


def stop_server(process: subprocess.Popen, timeout: float = 60) -> tuple[str, str]:
    """SIGTERM, and the server's output once it has exited (killed if it does not)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()
