"""`ruvllm serve A B BROKEN --models-max 1 --keep-alive 1s` as a user runs it, with the
openai SDK: alternating requests load and unload the two models, each answers as it
does served alone, the server's memory returns after each unload, an idle model is
unloaded after its keep-alive, an unknown model is a 404 and one that fails to load a
503 with Retry-After.

The models are tiny (fast to build, load and run), but each is served with a 128 MiB
KV pool, which the engine zeroes and so really holds: one loaded model is then about a
quarter of the server's resident memory, and "RSS within 10% of one model loaded"
fails if an unload frees nothing (a second engine resident would add 25%). The pool
is part of the engine like the weights are: whatever reference kept one alive would
keep both. A slow variant has the weights make up the memory (about 120 MB each),
which glibc keeps unless the unload trims the heap."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import click
import httpx
import openai
import psutil
import pytest

from ruvllm_cli.cli.serve_models import DURATION, NEVER
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.quantization import Quantization

from tests.server.conftest import build_server

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "the quick brown fox jumps over the lazy dog"
KV_POOL = 128 * 2**20
ENGINE = ("-q", "none", "--device", "cpu", "--max-context", "512")

pytestmark = pytest.mark.timeout(120)


@dataclass
class MultiServer:
    process: subprocess.Popen
    url: str
    names: tuple[str, ...]   # model a, model b (and the broken one)
    dirs: tuple[Path, Path]
    stderr: Path

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def statuses(self) -> dict[str, str]:
        return {m["id"]: m["status"] for m in httpx.get(self.url + "/v1/models").json()["data"]}

    def rss(self) -> int:
        return psutil.Process(self.process.pid).memory_info().rss


@contextmanager
def serving(models: Sequence[Path], root: Path, kv_pool: int,
            make_cli_env: Callable[..., dict[str, str]]) -> Iterator[MultiServer]:
    """`ruvllm serve MODELS --models-max 1 --keep-alive 1s` on a free port, stopped
    with SIGTERM afterwards (exit 0, nothing on stdout)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The per-test isolated directories may not be set yet (a module fixture): name them here.
    env = make_cli_env(RUVLLM_CACHE_DIR=str(root / "cache"), RUVLLM_CONFIG_DIR=str(root / "config"),
                          RUVLLM_DATA_DIR=str(root / "data"), HF_HOME=str(root / "hf"), RUVLLM_WEIGHT_CACHE="0")
    stderr = root / "stderr.txt"
    command = [sys.executable, "-m", "ruvllm_cli", "serve", *map(str, models), "--port", str(port),
               "--models-max", "1", "--keep-alive", "1s", *ENGINE, "--kv-cache-memory", str(kv_pool)]
    with stderr.open("w") as sink:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=sink, text=True)
    served = MultiServer(process, f"http://127.0.0.1:{port}", tuple(m.name for m in models),
                         (models[0], models[1]), stderr)
    try:
        wait_healthy(served)
        yield served
    finally:
        process.terminate()
        stdout, _ = process.communicate(timeout=30)
    assert process.returncode == 0, stderr.read_text()
    assert stdout == ""


@pytest.fixture(scope="module")
def multi_server(make_tiny_model, tiny_model_dir, tmp_path_factory, make_cli_env) -> Iterator[MultiServer]:
    """Two tiny models with 128 MiB KV pools, and a copy of one whose config.json is broken."""
    root = tmp_path_factory.mktemp("multi-model")
    broken = root / "broken"
    broken.mkdir()
    for file in tiny_model_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    b = make_tiny_model(seed=12, num_layers=3, intermediate_size=96)
    with serving([tiny_model_dir, b, broken], root, KV_POOL, make_cli_env) as served:
        yield served


def wait_healthy(served: MultiServer, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert served.process.poll() is None, served.stderr.read_text()
        try:
            if httpx.get(served.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError("the server never became healthy")


def streamed_reply(client: openai.OpenAI, model: str, while_held: Any = None) -> str:
    """A greedy reply streamed; `while_held()` runs after its first chunk, while the
    request holds its model (so it is loaded, whatever the keep-alive)."""
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    if while_held is not None:
        while_held()
    return text + "".join(chunk.choices[0].text for chunk in chunks)


def alone(model_dir: Path) -> str:
    """The same request to the model served alone (an in-process server of its own)."""
    live = build_server(load_model(model_dir, "cpu", Quantization.F32), names=("alone",),
                        engine={"max_model_len": 512})
    try:
        client = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
        return streamed_reply(client, "alone")
    finally:
        live.stop()


def test_alternating_requests_load_and_unload_the_models_and_memory_returns(multi_server):
    check_alternating(multi_server, KV_POOL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_returns_after_unloading_models_of_100_mb_weights(make_tiny_model, tmp_path, make_cli_env):
    """The same with the weights, not the KV pool, making up the model's memory: about
    120 and 110 MB of float32 weights beside 16 MiB pools. Fails without the unload's
    malloc_trim (glibc kept all of it: RSS 529 MiB loaded, 529 MiB idle)."""
    a = make_tiny_model(seed=11, hidden_size=512, num_layers=8, intermediate_size=2048)
    b = make_tiny_model(seed=12, hidden_size=512, num_layers=6, intermediate_size=2560)
    with serving([a, b], tmp_path, 16 * 2**20, make_cli_env) as served:
        check_alternating(served, sum(f.stat().st_size for f in b.glob("*.safetensors")))


def check_alternating(served: MultiServer, model_bytes: int) -> None:
    """A, B, A, B with --models-max 1: each request loads its model and unloads the
    other, each answers as alone, RSS stays within 10% whichever is loaded, and after
    --keep-alive the last one's unload gives back at least half its `model_bytes`."""
    a, b = served.names[:2]
    texts: dict[str, list[str]] = {a: [], b: []}
    rss: list[int] = []
    for model, other in ((a, b), (b, a), (a, b), (b, a)):
        def check() -> None:
            rss.append(served.rss())
            statuses = served.statuses()
            assert statuses[model] == "loaded" and statuses[other] == "unloaded"
        texts[model].append(streamed_reply(served.client, model, check))
    metrics = httpx.get(served.url + "/metrics").text
    assert f'ruvllm_model_loads_total{{model="{a}"}} 2.0' in metrics
    assert f'ruvllm_model_loads_total{{model="{b}"}} 2.0' in metrics
    assert f'ruvllm_model_unloads_total{{model="{a}"}} 2.0' in metrics
    # Each model answers as it does alone, load after load; the two differ.
    assert texts[a] == [alone(served.dirs[0])] * 2
    assert texts[b] == [alone(served.dirs[1])] * 2
    assert texts[a][0] != texts[b][0]
    # One model loaded at a time: RSS stays within 10% whichever it is and however often it changed.
    assert max(rss) <= 1.1 * min(rss), [r / 2**20 for r in rss]
    # --keep-alive 1s: the last one unloads by itself, and its memory goes back.
    deadline = time.monotonic() + 30
    while httpx.get(served.url + "/health").json()["models"][b] != "unloaded":
        assert time.monotonic() < deadline, "the idle model was never unloaded"
        time.sleep(0.1)
    assert served.rss() <= rss[-1] - model_bytes / 2, (served.rss() / 2**20, rss[-1] / 2**20)
    assert f"Unloaded {b} (idle for 1s)" in served.stderr.read_text()


def test_an_unknown_model_is_a_404_and_a_broken_one_a_503(multi_server):
    served = multi_server
    a, b, broken = served.names
    with pytest.raises(openai.NotFoundError) as caught:
        served.client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert caught.value.body["param"] == "model"
    assert f"This server serves: {a}, {served.dirs[0]}, {b}, {served.dirs[1]}, broken" in caught.value.body["message"]
    with pytest.raises(openai.APIStatusError) as failed:
        served.client.chat.completions.create(model="broken", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
    assert failed.value.status_code == 503 and int(failed.value.response.headers["Retry-After"]) >= 1
    assert failed.value.body["code"] == "model_load_failed"
    assert failed.value.body["message"].startswith("The model 'broken' failed to load: cannot read ")
    anthropic = httpx.post(served.url + "/v1/messages", json={
        "model": "broken", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic.status_code == 503 and anthropic.json()["error"]["type"] == "overloaded_error"
    assert served.statuses()["broken"] == "failed"
    health = httpx.get(served.url + "/health")
    assert health.status_code == 200 and health.json()["models"]["broken"] == "failed"
    assert streamed_reply(served.client, a)   # the others are still served
    banner = served.stderr.read_text()
    assert f"Models      {a}: unloaded (also {served.dirs[0]})" in banner
    assert "Warning: broken will not load: cannot read " in " ".join(banner.split())   # said at start
    assert "loaded on first use; at most 1 loaded at once; unloaded after 1s idle" in banner
    assert "broken failed to load: cannot read" in banner


@pytest.mark.parametrize("text, seconds", [("5m", 300.0), ("30s", 30.0), ("1h", 3600.0), ("1h30m", 5400.0),
                                           ("500ms", 0.5), ("0", 0.0), ("90", 90.0), ("-1", NEVER), ("-5m", NEVER), ("soon", None), ("5x", None), ("", None)])
def test_keep_alive_durations(text, seconds):
    if seconds is None:
        with pytest.raises(click.BadParameter):
            DURATION.convert(text, None, None)
    else:
        assert DURATION.convert(text, None, None) == seconds


@pytest.mark.parametrize("args, message", [
    (("{m}", "{m}"), "Error: MODEL {m} is given twice"),
    (("{m}", "other", "--served-model-name", "x"), "Error: --served-model-name names one model, and several"),
    (("{m}", "--keep-alive", "soon"), "'soon' is not a duration"),
    # --replicas is Ray's path, with one model: refused before Ray is imported or started.
    (("{m}", "other", "--replicas", "2"), "Error: --replicas serves one MODEL, without --models-max or --keep-alive"),
    (("{m}", "--models-max", "1", "--replicas", "2"), "Error: --replicas serves one MODEL"),
    (("{m}", "--keep-alive", "5m", "--max-replicas", "2"), "Error: --replicas serves one MODEL"),
])
def test_ambiguous_or_bad_model_options_are_refused_in_one_line(ruvllm, tiny_model_dir, args, message):
    result = ruvllm("serve", *(arg.format(m=tiny_model_dir) for arg in args))
    assert result.returncode == 2
    assert message.format(m=tiny_model_dir) in result.stderr
    assert "Traceback" not in result.stderr
