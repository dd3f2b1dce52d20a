"""`ruvllm serve` as a user runs it: options, start-up banner, /health, SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import namedtuple
from pathlib import Path

import click
import httpx
import pytest

from ruvllm_cli.cli.serve import BYTE_SIZE, served_names
from ruvllm_cli.registry.locate import locate_model

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("text, size", [("2GiB", 2 * 1024**3), ("512MiB", 512 * 1024**2), ("1.5G", 3 * 1024**3 // 2),
                                        ("500MB", 500 * 1000**2), ("4096", 4096), ("64 KiB", 64 * 1024)])
def test_sizes(text, size):
    assert BYTE_SIZE.convert(text, None, None) == size


@pytest.mark.parametrize("text", ["", "lots", "2XB", "-1", "0"])
def test_bad_sizes(text):
    with pytest.raises(click.BadParameter):
        BYTE_SIZE.convert(text, None, None)


def test_help_shows_the_server_options(ruvllm):
    result = ruvllm("serve", "--help")
    assert result.returncode == 0
    for option in ("--max-queue", "--shutdown-timeout", "--served-model-name", "--max-num-batched-tokens",
                   "--kv-cache-memory", "--no-prefix-cache", "--max-body-size", "--api-key", "--cors-origins",
                   "--max-prompts-per-request", "--max-sequences-per-request", "--max-tokens-default",
                   "--no-web-ui"):
        assert option in result.stdout


def test_a_bad_size_is_a_usage_error(ruvllm, tiny_model_dir):
    result = ruvllm("serve", str(tiny_model_dir), "--kv-cache-memory", "lots")
    assert result.returncode == 2
    assert "is not a size" in result.stderr


def test_a_busy_port_is_a_one_line_error(ruvllm, tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = ruvllm("serve", str(tiny_model_dir), "--port", str(port), timeout=60)
    assert result.returncode == 1
    assert f"Error: cannot listen on 127.0.0.1:{port}: address already in use" in result.stderr
    assert "Hint: pick another --port" in result.stderr and "Traceback" not in result.stderr


def test_a_host_that_does_not_resolve_is_a_one_line_error_about_the_host(ruvllm, tiny_model_dir, free_port):
    result = ruvllm("serve", str(tiny_model_dir), "--host", "no-such-host.invalid", "--port", str(free_port),
                    timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"Error: cannot listen on no-such-host.invalid:{free_port}: the host does not resolve" in result.stderr
    assert "Hint: give --host an address or name of this machine" in result.stderr
    assert "unknown error" not in result.stderr


def test_a_model_not_downloaded_stops_the_server_with_a_hint(ruvllm, free_port):
    result = ruvllm("serve", "qwen", "--port", str(free_port), timeout=60)
    assert result.returncode == 1
    assert "Error: qwen is not downloaded" in result.stderr
    assert "Hint: run: ruvllm download qwen" in result.stderr


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 60) -> list[int]:
    """Poll /health until 200; returns the statuses seen before."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            status = httpx.get(url + "/health", timeout=2).status_code
        except httpx.TransportError:
            status = 0
        if status == 200:
            return seen
        seen.append(status)
        time.sleep(0.05)
    raise AssertionError("the server never became healthy")


def test_serve_starts_answers_and_stops_cleanly_on_sigterm(tiny_model_dir, cli_env, free_port):
    port = free_port
    url = f"http://localhost:{port}"
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(tiny_model_dir), "--host", "localhost",
               "--port", str(port), "-q", "none", "--device", "cpu", "--max-context", "256",
               "--kv-cache-memory", "4MiB", "--served-model-name", "tiny", "--shutdown-timeout", "5"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=cli_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        seen = wait_healthy(url, process)
        assert set(seen) <= {0, 503}
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)   # in flight: the reply still finishes
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        stdout, stderr = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert stdout == ""
    assert f"OpenAI API  {url}/v1" in stderr
    assert re.search(r"KV cache    [34] MiB, [\d,]+ tokens of context \(--kv-cache-memory\)", stderr), stderr
    assert "Parsing     tool calls hermes, no reasoning markers" in stderr   # read from the chat template
    assert f"curl {url}/v1/chat/completions" in stderr and '"model": "tiny"' in stderr
    assert "Shutting down" in stderr and "Stopped." in stderr
    assert "Traceback" not in stderr


def test_a_model_path_is_served_as_typed_and_by_its_directory_name(tiny_model_dir, tmp_path):
    located = locate_model(str(tiny_model_dir), tmp_path)
    typed = str(tiny_model_dir) + "/"
    assert served_names(located, typed, ("tiny",)) == ["tiny", tiny_model_dir.name, typed]


def start_serve(model: Path | str, env: dict[str, str], port: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(model), "--port", str(port), "-q", "none",
               "--device", "cpu", "--served-model-name", "tiny", *extra]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_in_flight(url: str, requests: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while f"\nruvllm_http_requests_in_flight {float(requests)}\n" not in httpx.get(url + "/metrics").text:
        assert time.monotonic() < deadline, "the requests were never admitted"
        time.sleep(0.05)


def test_sigterm_ends_every_client_cleanly_within_the_shutdown_timeout(tiny_model_dir, cli_env, free_port):
    url = f"http://127.0.0.1:{free_port}"
    process = start_serve(tiny_model_dir, cli_env, free_port, "--max-context", "4096", "--kv-cache-memory", "16MiB",
                          "--shutdown-timeout", "2")
    long = {"model": "tiny", "max_tokens": 4000, "ignore_eos": True}   # ~20 s of tokens: outlives the timeout
    plain: list[httpx.Response] = []
    try:
        wait_healthy(url, process)
        waiter = threading.Thread(target=lambda: plain.append(
            httpx.post(url + "/v1/completions", json={**long, "prompt": "Once"}, timeout=30)))
        waiter.start()
        chat = {**long, "messages": [{"role": "user", "content": "Hello"}], "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            wait_in_flight(url, 2)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = [line for line in lines if line]   # raises if the chunked body breaks off
        stdout, stderr = process.communicate(timeout=30)
        exited = time.monotonic() - signalled
        waiter.join(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert exited <= 2 + 1, f"exited {exited:.2f} s after SIGTERM"
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):]) == {"error": {
        "message": "The request was cancelled because the server is shutting down.", "type": "service_unavailable",
        "param": None, "code": "shutting_down"}}
    assert plain[0].status_code == 503
    assert plain[0].json()["error"]["code"] == "shutting_down"
    assert "Traceback" not in stderr


def metric(url: str, name: str) -> float:
    """One unlabelled sample from /metrics."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def cache_tree(root: Path) -> dict[str, int]:
    """Every path under the cache with its size (-1 for directories)."""
    return {str(p.relative_to(root)): -1 if p.is_dir() else p.stat().st_size for p in sorted(root.rglob("*"))}


def read_stream(url: str, body: dict, lines: list[str]) -> None:
    """Collect a streamed reply's lines until the stream ends or breaks off."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
            lines.extend(line for line in response.iter_lines() if line)
    except httpx.TransportError as error:
        lines.append(f"broken: {type(error).__name__}")


def test_kill_9_mid_generation_then_the_same_port_and_cache_serve_cleanly(
        ruvllm, fake_hub, tiny_model_dir, cli_env, free_port, isolated_env):
    repo_id = f"ruvllm-tests/serve-kill-{uuid.uuid4().hex[:8]}"
    fake_hub.add_model_dir(repo_id, tiny_model_dir)
    assert ruvllm("download", repo_id).returncode == 0
    cache_before = cache_tree(isolated_env.cache_dir)
    url = f"http://127.0.0.1:{free_port}"
    options = ("--max-context", "4096", "--kv-cache-memory", "16MiB")
    long = {"model": "tiny", "max_tokens": 4000, "ignore_eos": True, "messages": [{"role": "user", "content": "Hi"}]}
    process = start_serve(repo_id, cli_env, free_port, *options)
    streams: list[list[str]] = [[], []]
    try:
        wait_healthy(url, process)
        readers = [threading.Thread(target=read_stream, args=(url, {**long, "stream": True}, lines))
                   for lines in streams]
        for reader in readers:
            reader.start()
        wait_in_flight(url, 2)
        deadline = time.monotonic() + 30
        while not all(streams):   # both replies are under way
            assert time.monotonic() < deadline, streams
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=30)
        for reader in readers:
            reader.join(30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == -signal.SIGKILL
    for lines in streams:   # cut off mid-reply: no [DONE]
        assert lines[0].startswith("data: ") and lines[-1].startswith("broken: "), lines[-3:]

    process = start_serve(repo_id, cli_env, free_port, *options)
    try:
        assert set(wait_healthy(url, process)) <= {0, 503}
        response = httpx.post(url + "/v1/chat/completions", json={**long, "max_tokens": 8}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
        assert metric(url, "ruvllm_http_requests_in_flight") == 0
        assert metric(url, "ruvllm_kv_cache_blocks_used") == 0
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert cache_tree(isolated_env.cache_dir) == cache_before
    listed = ruvllm("list", "--downloaded", "--json")
    assert [m["repo_id"] for m in json.loads(listed.stdout)["models"]] == [repo_id]


# The engine's device work raises on every step (a device that is gone): only the
# injected ModelRunner.execute differs from `ruvllm serve`.
_FAILING_SERVE = """
import sys
from ruvllm_cli.engine.model_runner import ModelRunner
def execute(self, chunks):
    raise RuntimeError("device lost")
ModelRunner.execute = execute
from ruvllm_cli.cli.main import main
sys.argv = ["ruvllm", *sys.argv[1:]]
main()
"""


def test_a_dead_engine_makes_serve_exit_non_zero(tiny_model_dir, cli_env, free_port):
    command = [sys.executable, "-c", _FAILING_SERVE, "serve", str(tiny_model_dir), "--port", str(free_port),
               "-q", "none", "--device", "cpu", "--served-model-name", "tiny", "--shutdown-timeout", "2"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=cli_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{free_port}"
    try:
        wait_healthy(url, process)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code >= 500 and response.json()["error"]["message"]
        # One failed forward fails its requests; a second in a row is the engine's, and the server's.
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code >= 500 and response.json()["error"]["message"]
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 1
    assert "Error: the engine failed: RuntimeError: device lost" in stderr
    assert "Traceback" not in stderr


def test_a_second_ctrl_c_ends_the_drain_at_once(tiny_model_dir, cli_env, free_port):
    url = f"http://127.0.0.1:{free_port}"
    process = start_serve(tiny_model_dir, cli_env, free_port, "--max-context", "4096", "--kv-cache-memory", "16MiB",
                          "--shutdown-timeout", "60")
    chat = {"model": "tiny", "max_tokens": 4000, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Hello"}]}
    try:
        wait_healthy(url, process)
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGINT)
            time.sleep(1.0)
            assert process.poll() is None   # draining: the reply still streams
            assert next(line for line in lines if line).startswith("data: {")
            process.send_signal(signal.SIGINT)
            signalled = time.monotonic()
            rest = [line for line in lines if line]   # raises if the chunked body breaks off
        stdout, stderr = process.communicate(timeout=30)
        exited = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert exited < 2, f"exited {exited:.2f} s after the second SIGINT"
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "shutting_down"
    assert "Ctrl+C again" in stderr and "Stopping now" in stderr and "Traceback" not in stderr


def test_the_kv_summary_says_what_sized_the_pool(tiny_model_dir, tmp_path, monkeypatch):
    import psutil

    from ruvllm_cli.cli.engine_setup import OpenedEngine
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.quantization import Quantization

    located = locate_model(str(tiny_model_dir), tmp_path)
    loaded = load_model(tiny_model_dir, "cpu", Quantization.F32)
    roomy = OpenedEngine(LLMEngine(loaded, EngineConfig(device="cpu", max_num_seqs=2, max_model_len=256)), located)
    assert roomy.kv_summary().endswith("512 tokens of context (room for 2 x 256 tokens)")
    # Little free memory: the share is what limits the pool, and the line says so.
    monkeypatch.setattr(psutil, "virtual_memory", lambda: namedtuple("Memory", "available")(4 * 2**20))
    tight = OpenedEngine(LLMEngine(loaded, EngineConfig(device="cpu", max_num_seqs=64, max_model_len=4096)),
                         located)
    summary = tight.kv_summary()
    assert re.fullmatch(r"1 MiB, [\d,]+ tokens of context \(25% of free memory; --kv-cache-memory sets it\)"
                        r"(; it caps the context at [\d,]+ of 4,096 tokens)?", summary), summary
    assert roomy.context_note(256) is None and roomy.context_note(100_000) == (
        f"--max-context 100,000 is more than this model takes: its context is {roomy.engine.max_model_len:,} tokens")
    # A pool smaller than one context, given in KiB: its true size, and the cap it puts on the context.
    small = OpenedEngine(LLMEngine(loaded, EngineConfig(device="cpu", max_model_len=256, kv_cache_memory=96 * 2**10)),
                         located)
    assert re.fullmatch(r"96 KiB, (\d+) tokens of context \(--kv-cache-memory\); it caps the context at \1 of "
                        r"256 tokens", small.kv_summary()), small.kv_summary()


def test_a_kv_pool_too_small_to_answer_is_refused_at_start(ruvllm, tiny_model_dir, free_port):
    """--kv-cache-memory 1KiB held 16 tokens: the server started, /health said 200, and
    every chat request (the banner's own example) was "too long"."""
    result = ruvllm("serve", str(tiny_model_dir), "--port", str(free_port), "-q", "none", "--device", "cpu",
                    "--kv-cache-memory", "1KiB", timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith(("Error:", "Hint:"))]
    assert re.fullmatch(r"Error: the KV cache \(\d+ KiB, --kv-cache-memory\) holds 16 tokens of context, fewer "
                        r"than the 256 a server needs to answer requests", errors[0]), errors
    assert re.fullmatch(r"Hint: give --kv-cache-memory \d+ KiB or more \(256 tokens of this model\)", errors[1])


def test_a_pool_that_caps_the_context_to_a_usable_one_is_served(tiny_model_dir, tmp_path):
    from ruvllm_cli.cli.engine_setup import OpenedEngine
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.errors import UsageError
    from ruvllm_cli.quantization import Quantization

    located = locate_model(str(tiny_model_dir), tmp_path)
    loaded = load_model(tiny_model_dir, "cpu", Quantization.F32)
    probe = LLMEngine(loaded, EngineConfig(device="cpu", max_model_len=64))
    per_block = probe.kv_cache_bytes // probe.block_manager.num_blocks

    def opened(blocks: int, context: int) -> OpenedEngine:
        config = EngineConfig(device="cpu", max_model_len=context, kv_cache_memory=blocks * per_block)
        return OpenedEngine(LLMEngine(loaded, config), located)

    opened(16, 4096).check_served_context()   # 256 of 4,096 tokens: capped, served
    opened(4, 64).check_served_context()      # all of a short context asked for
    with pytest.raises(UsageError, match="holds 240 tokens of context, fewer than the 256"):
        opened(15, 4096).check_served_context()
    with pytest.raises(UsageError, match="holds 48 tokens of context, fewer than the 64"):
        opened(3, 64).check_served_context()
