"""LoRA adapters through the server, with the official openai SDK: adapters are models
(`model` = NAME on every generation route, /v1/models with `parent`), their replies are the engine's for that
adapter, their prefix-cache blocks stay apart, and adapters load and unload at run
time over HTTP (vLLM's routes) only when allowed and behind the API key."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

import httpx
import openai
import pytest

from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.testing.tiny_lora import ATTENTION, MLP, build_lora_adapter

from tests.server.conftest import LiveServer, start_adapter_server

pytestmark = pytest.mark.timeout(120)

PROMPT = "the quick brown fox jumps over the lazy dog and keeps running far away"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-adapters")
    return {"attn": build_lora_adapter(tiny_model_dir, root / "attn", rank=4, targets=ATTENTION, seed=1),
            "mlp": build_lora_adapter(tiny_model_dir, root / "mlp", rank=8, targets=MLP, seed=2)}


@pytest.fixture(scope="module")
def lora_model(tiny_model_dir):
    # A model of its own: adapters wrap its layers, and other tests' servers share theirs.
    return load_model(tiny_model_dir, "cpu", Quantization.F32)


@pytest.fixture
def lora_server(lora_model, adapters):
    made = []

    def make(names=("attn", "mlp"), **app_options) -> LiveServer:
        live = start_adapter_server(lora_model, {name: adapters[name] for name in names},
                                    engine={"max_num_seqs": 8, "block_size": 4}, **app_options)
        made.append(live)
        return live

    yield make
    for live in made:
        live.assert_clean()
        live.stop()


def client_for(live: LiveServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)


def greedy(client, model, **kwargs):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}, **kwargs)


def test_adapters_are_models_with_their_base_as_parent(lora_server):
    live = lora_server()
    models = {m.id: m for m in client_for(live).models.list().data}
    assert list(models) == ["tiny", "org/tiny-model", "attn", "mlp"]
    assert models["attn"].parent == "tiny" and models["mlp"].parent == "tiny"
    assert models["tiny"].parent is None


def test_a_request_naming_an_adapter_gets_that_adapters_tokens(lora_server):
    live = lora_server()
    client = client_for(live)
    prompt_ids = live.engine(lambda e: e.tokenizer.encode(PROMPT))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for model, adapter in (("tiny", None), ("attn", "attn"), ("mlp", "mlp")):
        reply = greedy(client, model)
        assert reply.model == model
        expected = live.engine(lambda e: e.generate([prompt_ids], params, adapters=adapter)[0].text)
        assert reply.choices[0].text == expected, model
    texts = {greedy(client, m).choices[0].text for m in ("tiny", "attn", "mlp")}
    assert len(texts) == 3   # each adapter really changes the reply


def test_streamed_chat_with_an_adapter(lora_server):
    live = lora_server()
    client = client_for(live)
    messages = [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="mlp", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].message.content
    stream = client.chat.completions.create(model="mlp", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole


def test_the_responses_api_takes_an_adapter_as_its_model(lora_server):
    live = lora_server(names=("mlp",))
    client = client_for(live)
    messages = [{"role": "user", "content": PROMPT}]
    texts = set()
    for model in ("tiny", "mlp"):
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].message.content
        reply = client.responses.create(model=model, input=PROMPT, max_output_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert reply.model == model and reply.output_text == chat
        texts.add(reply.output_text)
    assert len(texts) == 2   # the adapter really changes the reply


def test_prefix_cache_shared_within_an_adapter_not_across(lora_server):
    live = lora_server()
    client = client_for(live)
    cached = [greedy(client, m).usage.prompt_tokens_details.cached_tokens for m in ("attn", "attn", "mlp", "tiny")]
    assert cached[0] == 0 and cached[1] > 0
    assert cached[2] == 0 and cached[3] == 0


def test_an_unknown_model_is_a_404_naming_the_adapters(lora_server):
    live = lora_server()
    with pytest.raises(openai.NotFoundError) as caught:
        greedy(client_for(live), "nope")
    assert "attn" in str(caught.value) and "mlp" in str(caught.value)


def test_runtime_loading_is_off_unless_allowed(lora_server, adapters):
    live = lora_server()
    answer = httpx.post(live.base_url + "/load_lora_adapter",
                        json={"lora_name": "x", "lora_path": str(adapters["attn"])})
    assert answer.status_code == 404
    assert "--allow-runtime-lora" in answer.json()["error"]["message"]
    assert "x" not in [m.id for m in client_for(live).models.list().data]


def test_load_use_and_unload_at_run_time(lora_server, adapters, tmp_path):
    live = lora_server(names=(), allow_runtime_lora=True)
    client = client_for(live)
    base_text = greedy(client, "tiny").choices[0].text
    url = live.base_url
    answer = httpx.post(url + "/load_lora_adapter", json={"lora_name": "fresh", "lora_path": str(adapters["mlp"])})
    assert answer.status_code == 200 and "fresh" in answer.text
    assert [m.id for m in client.models.list().data][-1] == "fresh"
    assert greedy(client, "fresh").choices[0].text != base_text
    again = httpx.post(url + "/load_lora_adapter", json={"lora_name": "fresh", "lora_path": str(adapters["mlp"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    taken = httpx.post(url + "/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(adapters["mlp"])})
    assert taken.status_code == 400 and "name of a model this server serves" in taken.json()["error"]["message"]
    # "tiny:latest" is tiny's name on every API: an adapter so named took it over (a helper's pass)
    tagged = httpx.post(url + "/load_lora_adapter", json={"lora_name": "tiny:latest",
                                                          "lora_path": str(adapters["mlp"])})
    assert tagged.status_code == 400 and "may not end in ':latest'" in tagged.json()["error"]["message"]
    missing = httpx.post(url + "/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "no")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    not_lora = httpx.post(url + "/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert not_lora.status_code == 400
    assert httpx.post(url + "/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
    # NUL is text elsewhere in a body, but no file name holds one (os calls raise ValueError)
    for field, value in (("lora_path", str(adapters["mlp"]) + "\x00"), ("lora_name", "a\x00b")):
        nul = httpx.post(url + "/load_lora_adapter", json={"lora_name": "nul", "lora_path": str(adapters["mlp"]),
                                                           field: value})
        assert nul.status_code == 400 and nul.json()["error"]["param"] == field, nul.text
    done = httpx.post(url + "/unload_lora_adapter", json={"lora_name": " fresh "})   # trimmed, as the load trims
    assert done.status_code == 200 and "removed" in done.text
    with pytest.raises(openai.NotFoundError):
        greedy(client, "fresh")
    unknown = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "fresh"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_load_inplace_swaps_the_weights_under_the_same_name(lora_server, adapters, tmp_path):
    """vLLM's load_inplace (a trainer's hot swap): it was ignored, and the name already
    loaded answered 400."""
    live = lora_server(names=(), allow_runtime_lora=True)
    client, url = client_for(live), live.base_url
    load = lambda name, path, **more: httpx.post(url + "/load_lora_adapter", timeout=60,  # noqa: E731
                                                 json={"lora_name": name, "lora_path": str(path), **more})
    assert load("swap", adapters["mlp"], load_inplace=True).status_code == 200   # a new name: a plain load
    assert load("other", adapters["attn"]).status_code == 200
    mlp_text, attn_text = greedy(client, "swap").choices[0].text, greedy(client, "other").choices[0].text
    assert mlp_text != attn_text
    replaced = load("swap", adapters["attn"], load_inplace=True)
    assert replaced.status_code == 200 and "replaced" in replaced.text
    assert greedy(client, "swap").choices[0].text == attn_text   # no KV of the old weights reused
    broken = load("swap", tmp_path, load_inplace=True)
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "lora_path"
    assert greedy(client, "swap").choices[0].text == attn_text   # the old weights stay
    assert [m.id for m in client.models.list().data].count("swap") == 1


def test_an_adapter_the_hub_cannot_give_is_a_503_not_a_client_error(lora_server, tmp_path, monkeypatch, free_port):
    """The hub out of reach is the server's trouble: 503 adapter_download_failed (it was a
    500 with code invalid_value)."""
    from huggingface_hub import constants

    dead = f"http://127.0.0.1:{free_port}"   # nothing listens there
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    live = lora_server(names=(), allow_runtime_lora=True, cache_dir=str(tmp_path))
    answer = httpx.post(live.base_url + "/load_lora_adapter", timeout=60,
                        json={"lora_name": "far", "lora_path": "someone/some-lora"})
    error = answer.json()["error"]
    assert answer.status_code == 503 and error["code"] == "adapter_download_failed", answer.text
    assert error["param"] == "lora_path" and "cannot reach the Hugging Face hub" in error["message"]


def test_unloading_an_adapter_in_use_is_a_409(lora_server):
    live = lora_server(allow_runtime_lora=True)
    client = client_for(live)
    started = threading.Event()
    outcome = {}

    def long_request():
        stream = client.completions.create(model="attn", prompt=PROMPT, max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        count = 0
        for _ in stream:
            count += 1
            started.set()
        outcome["chunks"] = count

    worker = threading.Thread(target=long_request)
    worker.start()
    assert started.wait(60)
    busy = httpx.post(live.base_url + "/unload_lora_adapter", json={"lora_name": "attn"})
    worker.join(120)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_in_use"
    assert outcome["chunks"] > 1
    assert httpx.post(live.base_url + "/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 200


def test_an_adapter_unloaded_while_its_request_is_queued_is_a_404(lora_server, adapters):
    """A helper's pass: the name is checked in the handler's thread and the request then
    queued for the engine thread; an unload that ran in between failed the request
    with a 500 ("The engine failed on this request"). Now the 404 an unknown name gets,
    whole and streamed."""
    live = lora_server(allow_runtime_lora=True)
    assert live.engine_loop is not None
    commands = live.engine_loop._commands

    def unload_behind(request: Callable[[], Any]) -> Any:
        """`request` in a thread while the engine thread waits for its add to be queued,
        then unloads the adapter before that add runs."""
        def unload_once_queued(engine):
            deadline = time.monotonic() + 30
            while commands.qsize() == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            engine.remove_lora("attn")

        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.update(value=request()))
        blocker = threading.Thread(target=live.engine, args=(unload_once_queued,))
        blocker.start()
        time.sleep(0.2)   # the engine thread is in unload_once_queued
        worker.start()
        worker.join(60)
        blocker.join(60)
        return result["value"]

    for stream in (False, True):
        body = {"model": "attn", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
        reply = unload_behind(lambda: httpx.post(live.base_url + "/completions", json=body, timeout=60))
        if stream:   # the stream had begun: its one event is the error, in the API's shape
            [event] = [json.loads(line[6:]) for line in reply.text.splitlines()
                       if line.startswith("data: {")]
            error = event["error"]
        else:
            assert reply.status_code == 404, reply.text
            error = reply.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model"), error
        assert httpx.post(live.base_url + "/load_lora_adapter", timeout=60,
                          json={"lora_name": "attn", "lora_path": str(adapters["attn"])}).status_code == 200


def test_runtime_loading_needs_the_api_key(lora_server, adapters):
    live = lora_server(names=(), allow_runtime_lora=True, api_key="sesame")
    body = {"lora_name": "x", "lora_path": str(adapters["attn"])}
    assert httpx.post(live.base_url + "/load_lora_adapter", json=body).status_code == 401
    keyed = httpx.post(live.base_url + "/load_lora_adapter", json=body, headers={"Authorization": "Bearer sesame"})
    assert keyed.status_code == 200
    assert "x" in [m.id for m in client_for(live, "sesame").models.list().data]


def test_serve_with_a_local_and_a_hub_adapter(tiny_model_dir, adapters, fake_hub, cli_env, free_port):
    """`ruvllm serve MODEL --lora a=DIR --lora b=OWNER/NAME`: the hub one is fetched
    through the registry's download path (the real huggingface_hub client, the fake hub)."""
    import subprocess
    import sys
    import uuid

    from tests.server.test_serve_cli import REPO_ROOT, wait_healthy

    repo_id = f"org/tiny-lora-{uuid.uuid4().hex[:8]}"
    fake_hub.add_model_dir(repo_id, adapters["mlp"])
    url = f"http://127.0.0.1:{free_port}"
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(tiny_model_dir), "--port", str(free_port),
               "-q", "none", "--device", "cpu", "--max-context", "256", "--kv-cache-memory", "4MiB",
               "--served-model-name", "tiny", "--lora", f"local={adapters['attn']}", "--lora", f"hub={repo_id}"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=cli_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, process)
        models = httpx.get(url + "/v1/models").json()["data"]
        assert models[0]["id"] == "tiny" and models[0]["parent"] is None
        assert [(m["id"], m["parent"]) for m in models if m["parent"]] == [("local", "tiny"), ("hub", "tiny")]
        body = {"model": "hub", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).json()["usage"]["completion_tokens"] == 4
        # while it runs, `ruvllm rm` can see what it serves (registry/in_use.py)
        from ruvllm_cli.registry.in_use import run_dir, users_of

        cache_dir = cli_env["RUVLLM_CACHE_DIR"]
        [user] = users_of([tiny_model_dir], cache_dir)
        assert user["pid"] == process.pid and user["url"] == url
        process.send_signal(subprocess.signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
        assert not list(run_dir(cache_dir).glob("serve-*.json"))   # gone with the server
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert "LoRA        local, hub (as model names)" in stderr
    assert "LoRA adapter local (rank 4, 8 layers: k_proj, o_proj, q_proj, v_proj)" in stderr
    assert fake_hub.file_requests("adapter_model.safetensors")
    # The fetched adapter sits in the model cache like a model: `ruvllm list` shows it.
    listed = subprocess.run([sys.executable, "-m", "ruvllm_cli", "list", "--downloaded", "--json"], cwd=REPO_ROOT,
                            env=cli_env, capture_output=True, text=True, timeout=60)
    assert any(m.get("stored_as") == "LoRA adapter f32" for m in json.loads(listed.stdout)["models"]), listed.stdout


def test_serve_refuses_a_missing_adapter_before_binding(ruvllm, tiny_model_dir, tmp_path, free_port):
    result = ruvllm("serve", str(tiny_model_dir), "--port", str(free_port), "--lora", f"x={tmp_path / 'nope'}",
                    timeout=60)
    assert result.returncode != 0
    assert "Error: no adapter directory" in result.stderr and "Traceback" not in result.stderr
    assert "Listening" not in result.stderr and "Fetching" not in result.stderr   # a path, not a hub id


def test_serve_refuses_an_adapter_named_as_a_model(ruvllm, tiny_model_dir, make_tiny_model, adapters, free_port):
    """The model would take every request naming it: the adapter could never be reached."""
    other = make_tiny_model(num_layers=3)
    for models, name in (([tiny_model_dir], tiny_model_dir.name), ([tiny_model_dir, other], other.name)):
        result = ruvllm("serve", *map(str, models), "--port", str(free_port), "--lora",
                        f"{name}={adapters['mlp']}", timeout=60)
        assert result.returncode == 2, result.stderr
        assert f"Error: --lora {name}: {name} is also a name of a MODEL" in result.stderr
        assert "Traceback" not in result.stderr and "ValueError" not in result.stderr



def test_an_adapter_loaded_right_after_the_server_is_healthy(tiny_model_dir, adapters, cli_env, free_port,
                                                            tmp_path):
    """The usual deployment script: wait for /health, then load adapters. With the checked
    tokenizer (weight cache on, a second start) the first load raced its background
    import of transformers, which peft imports too: a 500 "cannot import name 'AutoModel'"."""
    import shutil
    import subprocess
    import sys

    from tests.server.test_serve_cli import REPO_ROOT, wait_healthy

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")   # the weight cache is written beside it
    url = f"http://127.0.0.1:{free_port}"
    command = [sys.executable, "-m", "ruvllm_cli", "serve", str(model), "--port", str(free_port),
               "--device", "cpu", "--max-context", "256", "--kv-cache-memory", "4MiB", "--served-model-name", "tiny",
               "--allow-runtime-lora"]
    for start in range(2):
        process = subprocess.Popen(command, cwd=REPO_ROOT, env={**cli_env, "RUVLLM_WEIGHT_CACHE": "1"},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_healthy(url, process)
            loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "mlp",
                                                                     "lora_path": str(adapters["mlp"])}, timeout=60)
            assert loaded.status_code == 200, (start, loaded.text)
            process.send_signal(subprocess.signal.SIGTERM)
            process.communicate(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
