"""`ruvllm serve MODEL --replicas 2` as a user runs it: a local Ray cluster on
127.0.0.1 (2 CPUs), two replicas of the tiny model with one thread each, the openai
SDK in front. One server for the module (its start is most of the time)."""

from __future__ import annotations

import ipaddress
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from cluster_helpers import REPO_ROOT, free_port, server_env, stop_server, wait_healthy

ray = pytest.importorskip("ray", reason="the cluster extra is not installed (pip install -e '.[cluster]')")

pytestmark = pytest.mark.timeout(300)
MAX_CONTEXT = 2048


class Replicas:
    def __init__(self, url: str, process: subprocess.Popen, started_in: float) -> None:
        self.url, self.process, self.started_in = url, process, started_in
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=10).json()

    def served(self) -> dict[str, int]:
        return {r["replica_id"]: r["requests"] for r in self.health()["replicas"]}


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    port = free_port()
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(tiny_model_dir), "--replicas", "2",
               "--threads-per-replica", "1", "--port", str(port), "-q", "none", "--device", "cpu",
               "--served-model-name", "tiny", "--max-context", str(MAX_CONTEXT), "--kv-cache-memory", "16MiB",
               "--shutdown-timeout", "2"]
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=server_env(tmp_path_factory.mktemp("replicas")),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, timeout=240)
        yield Replicas(f"http://127.0.0.1:{port}", process, time.monotonic() - started)
    finally:
        stdout, stderr = stop_server(process)
    assert process.returncode == 0, stderr
    assert stdout == ""
    assert "Replicas    2 x (1 CPU thread) on a local Ray cluster (127.0.0.1); prefix-aware routing" in stderr
    # Ray's driver puts abseil's failure handler on SIGTERM (a stack dump, then SIGABRT 3 s
    # later, whatever the drain still had to do); the server takes SIGTERM back.
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr
    # Without --verbose the start says only ruvllm's own lines: none of Serve's progress
    # (INFO) nor Ray's warnings about its SIGTERM handler or token authentication.
    start = stderr.split("Press Ctrl+C to stop.")[0]
    assert not re.search(r"INFO|WARNING|SIGTERM handler|Token authentication", start), start


def test_the_openai_sdk_through_the_router(replicas: Replicas):
    client = replicas.client
    assert [m.id for m in client.models.list().data][0] == "tiny"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=8, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6
    completion = client.completions.create(model="tiny", prompt=["Once upon", "a time"], max_tokens=4, n=2,
                                           extra_body={"ignore_eos": True})
    assert len(completion.choices) == 4 and completion.usage.completion_tokens == 16
    health = replicas.health()
    assert health["status"] == "ok" and health["replica_states"] == {"RUNNING": 2}
    assert {r["node_ip"] for r in health["replicas"]} == {"127.0.0.1"}


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)   # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_the_local_cluster_listens_on_the_loopback_interface(replicas: Replicas):
    import psutil

    outside: dict[str, list[str]] = {}
    for process in [psutil.Process(replicas.process.pid), *psutil.Process(replicas.process.pid).children(True)]:
        try:
            sockets = process.net_connections(kind="inet")
            name = process.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for sock in sockets:
            if sock.status == psutil.CONN_LISTEN and not loopback(sock.laddr.ip):
                outside.setdefault(f"{name} ({process.pid})", []).append(f"{sock.laddr.ip}:{sock.laddr.port}")
    # Ray Serve binds each replica's inter-deployment gRPC server to [::]:0 itself
    # (serve/_private/replica.py); every other Ray process keeps to 127.0.0.1.
    assert all(name.startswith("ray::ServeRepli") and len(ports) == 1 for name, ports in outside.items()), outside


def test_bad_requests_are_answered_by_the_front_door(replicas: Replicas):
    with pytest.raises(openai.BadRequestError) as too_long:
        replicas.client.completions.create(model="tiny", prompt=[5] * (MAX_CONTEXT + 10), max_tokens=4)
    assert too_long.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        replicas.client.completions.create(model="other", prompt="Hi", max_tokens=4)
    # runtime LoRA loading is refused for what it is here, not as a flag to add (refused with --replicas)
    answer = httpx.post(str(replicas.client.base_url.join("load_lora_adapter")),
                        json={"lora_name": "x", "lora_path": "/nowhere"}, timeout=30)
    assert answer.status_code == 404 and "--lora when starting" in answer.json()["error"]["message"]


def test_metrics_add_up_both_engines(replicas: Replicas):
    text = httpx.get(replicas.url + "/metrics", timeout=10).text
    totals = [float(line.split()[1]) for line in text.splitlines() if line.startswith("ruvllm_kv_cache_blocks_total ")]
    # 16 MiB of float32 KV per replica is 2,048 blocks of the tiny model: two replicas, twice that.
    assert totals == [4096.0]


def test_prompts_sharing_a_prefix_land_where_it_is_cached(replicas: Replicas):
    rng = random.Random(25)
    prefixes = [[rng.randrange(3, 500) for _ in range(480)] for _ in range(4)]
    before = replicas.health()["routing"]["affinity"]
    for turn in range(3):
        for prefix in prefixes:
            prompt = prefix + [rng.randrange(3, 500) for _ in range(8)]
            usage = replicas.client.completions.create(model="tiny", prompt=prompt, max_tokens=2).usage
            assert usage.prompt_tokens == 488
            if turn:   # every request after the first of its prefix: nearly all of it cached
                assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens, (turn, usage)
    assert replicas.health()["routing"]["affinity"] - before == 8


def test_prompts_with_no_shared_prefix_spread_over_both_replicas(replicas: Replicas):
    before = replicas.served()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(16)]
    threads = [threading.Thread(target=lambda p=p: replicas.client.completions.create(
        model="tiny", prompt=p, max_tokens=8)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    after = replicas.served()
    assert sum(after.values()) - sum(before.values()) == 16
    assert all(after[r] > before.get(r, 0) for r in after), (before, after)


# ---- faults (slow: the killed replica's restart takes 10-20 s) ------------------------------
def long_request(client: openai.OpenAI, i: int, stream: bool, results: dict[int, Any]) -> None:
    body = dict(model="tiny", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=600,
                extra_body={"ignore_eos": True})
    try:
        if stream:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body))
            results[i] = ("ok", chunks[-1].usage.completion_tokens)
        else:
            results[i] = ("ok", client.chat.completions.create(**body).usage.completion_tokens)
    except openai.APIStatusError as error:          # a 503 before the body
        results[i] = (error.status_code, error.body["code"])
    except openai.APIError as error:                # an error event on a stream that had started
        results[i] = ("event", (error.body or {}).get("code"))


def wait_all_placed(replicas: Replicas, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        placed = replicas.health()["replicas"]
        if sum(r["in_flight"] for r in placed) == count:
            return placed
        time.sleep(0.05)
    raise AssertionError("the requests never all reached a replica")


def replaced(health: dict[str, Any], victim: str) -> bool:
    return health["replica_states"] == {"RUNNING": 2} and victim not in {r["replica_id"] for r in health["replicas"]}


@pytest.mark.slow
def test_a_killed_replica_fails_only_its_own_requests_and_comes_back(replicas: Replicas):
    results: dict[int, Any] = {}
    threads = [threading.Thread(target=long_request, args=(replicas.client, i, i % 2 == 0, results))
               for i in range(6)]
    for thread in threads:
        thread.start()
    placed = wait_all_placed(replicas, 6)
    victim = max(placed, key=lambda r: r["in_flight"])
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    # Meanwhile a new request is served by the other replica (or sent again if it met the dead one).
    fresh = replicas.client.completions.create(model="tiny", prompt="after the kill", max_tokens=4,
                                              extra_body={"ignore_eos": True})
    assert fresh.usage.completion_tokens == 4
    for thread in threads:
        thread.join(120)
    failed = {i: r for i, r in results.items() if r[0] != "ok"}
    assert len(results) == 6 and len(failed) == victim["in_flight"], results
    assert set(failed.values()) <= {(503, "replica_unavailable"), ("event", "replica_unavailable")}
    assert all(r == ("ok", 600) for i, r in results.items() if i not in failed)
    # Replaced: two running again, the killed one not among them (the front door reads
    # Serve's states once a second, and Serve's controller notices a death after Ray does:
    # just after the kill /health may still show the victim running beside the other).
    while not replaced(replicas.health(), victim["replica_id"]):
        assert time.monotonic() - killed < 60, replicas.health()
        time.sleep(0.5)
    after = replicas.client.completions.create(model="tiny", prompt="back again", max_tokens=4,
                                              extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 4


@pytest.mark.slow
def test_a_replica_that_cannot_start_says_why_as_one_process_would(tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """A helper's pass: serve.run's error said only "Failed to update the deployments
    ['EngineReplica']" (the reason was in --verbose's logs), and a KV pool too small to
    serve was not refused with replicas at all (they served "context 128 tokens")."""
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(tiny_model_dir), "--replicas", "1",
               "--threads-per-replica", "1", "--port", str(free_port()), "-q", "none", "--device", "cpu",
               "--kv-cache-memory", "64KiB"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=server_env(tmp_path), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 1, done.stderr
    assert "Error: the KV cache (64 KiB, --kv-cache-memory) holds 128 tokens of context, fewer than the 256 a " \
           "server needs to answer requests" in done.stderr
    assert "Traceback" not in done.stderr
