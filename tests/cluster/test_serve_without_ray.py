"""`ruvllm serve` without --replicas never imports Ray, and --replicas without Ray
installed is a one-line error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from cluster_helpers import REPO_ROOT, free_port, server_env, stop_server, wait_healthy

# On the server's path: any import of ray (or a look for it) ends the process with a marker.
NO_RAY = '''
import importlib.abc, os, sys

class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            sys.stderr.write("RAY-IMPORTED\\n")
            sys.stderr.flush()
            os._exit(3)
        return None

sys.meta_path.insert(0, NoRay())
'''


def test_serve_without_replicas_never_imports_ray(tiny_model_dir: Path, tmp_path: Path):
    (tmp_path / "sitecustomize.py").write_text(NO_RAY)
    env = server_env(tmp_path)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "ruvllm_cli", "serve", str(tiny_model_dir), "--port", str(port),
                                "-q", "none", "--device", "cpu", "--served-model-name", "tiny", "--max-context", "256",
                                "--kv-cache-memory", "4MiB"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, timeout=120)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert "ray" not in httpx.get(f"http://127.0.0.1:{port}/health").json()
    finally:
        _, stderr = stop_server(process)
    assert "RAY-IMPORTED" not in stderr
    assert process.returncode == 0, stderr


def test_replicas_without_ray_installed_is_a_one_line_error(tiny_model_dir: Path, tmp_path: Path):
    (tmp_path / "sitecustomize.py").write_text(NO_RAY.replace("os._exit(3)", "raise ImportError(name)")
                                               .replace('sys.stderr.write("RAY-IMPORTED\\\\n")', "pass"))
    env = server_env(tmp_path)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    done = subprocess.run([sys.executable, "-m", "ruvllm_cli", "serve", str(tiny_model_dir), "--replicas", "2",
                           "--port", str(free_port())], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Error: --replicas needs Ray Serve, which is not installed" in done.stderr
    assert 'pip install "ruvllm-cli[cluster]"' in done.stderr
    assert "Traceback" not in done.stderr
