"""`ruvllm serve --min-replicas 1 --max-replicas 2`: under a queue longer than one
batch, Ray Serve's autoscaler adds the second replica (slow: its 30 s delay, then the
new replica loads the model)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cluster_helpers import REPO_ROOT, free_port, server_env, stop_server, wait_healthy

pytest.importorskip("ray", reason="the cluster extra is not installed (pip install -e '.[cluster]')")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def keep_busy(url: str, stop: threading.Event) -> None:
    body = {"model": "tiny", "prompt": "load", "max_tokens": 400, "ignore_eos": True}
    while not stop.is_set():
        try:
            httpx.post(url + "/v1/completions", json=body, timeout=120)
        except httpx.TransportError:
            return   # the server stopped


def test_a_long_queue_adds_a_replica(tiny_model_dir: Path, tmp_path: Path):
    url = f"http://127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(tiny_model_dir), "--min-replicas", "1",
               "--max-replicas", "2", "--threads-per-replica", "1", "--max-concurrent", "2", "--port",
               url.rsplit(":", 1)[1], "-q", "none", "--device", "cpu", "--served-model-name", "tiny",
               "--max-context", "1024", "--kv-cache-memory", "8MiB"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=server_env(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    clients = [threading.Thread(target=keep_busy, args=(url, stop)) for _ in range(8)]
    try:
        wait_healthy(url, process, timeout=240)
        assert httpx.get(url + "/health").json()["replica_states"] == {"RUNNING": 1}
        for client in clients:
            client.start()
        deadline = time.monotonic() + 240
        while httpx.get(url + "/health").json()["replica_states"].get("RUNNING", 0) < 2:
            assert time.monotonic() < deadline, httpx.get(url + "/health").json()
            time.sleep(1)
        # The new replica takes requests: both have served some once it is running.
        deadline = time.monotonic() + 120
        while min(r["requests"] for r in httpx.get(url + "/health").json()["replicas"]) == 0:
            assert time.monotonic() < deadline, httpx.get(url + "/health").json()
            time.sleep(1)
    finally:
        stop.set()
        _, stderr = stop_server(process)
        for client in clients:
            if client.ident is not None:
                client.join(30)
    # Requests were in flight at the SIGTERM: the drain outlasts Ray's 3-second abort alarm,
    # which the server keeps off SIGTERM (serve.take_back_signals).
    assert process.returncode == 0, stderr
    assert "Replicas    1-2 (autoscaled, 1 at start) x (1 CPU thread)" in stderr
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr
