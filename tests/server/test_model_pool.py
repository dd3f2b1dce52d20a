"""The model pool in the app (server/models.py), in process and with the openai SDK:
models load on first use and share one load, the least recently used idle one makes
room, a busy one is waited for (within a timeout), a failed load is a 503 in the
route's shape, keep-alive unloads, runtime LoRA adapters come back with their model,
and stopping the app stops every engine it loaded."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import httpx
import openai
import pytest

from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.loop import EngineLoop
from ruvllm_cli.errors import ModelLoadError, RuvllmError
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.server import ModelSpec, PoolSettings, ServerConfig, attach_models, create_app
from ruvllm_cli.testing.tiny_lora import MLP, build_lora_adapter

from tests.server.conftest import LiveServer, ServerThread

pytestmark = pytest.mark.timeout(60)

PROMPT = "the quick brown fox jumps over the lazy dog"


class Loads:
    """Loaders for the pool that count their calls and keep every engine loop they made;
    `gate` (when set) holds each load until the test opens it."""

    def __init__(self, model_dir: Any) -> None:
        self.model_dir = model_dir
        self.calls: dict[str, int] = {}
        self.loops: list[EngineLoop] = []
        self.gate: threading.Event | None = None
        self.failing: set[str] = set()

    def loader(self, name: str) -> Callable[[Any], EngineLoop]:
        def load(adapters: Any) -> EngineLoop:
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.gate is not None:
                assert self.gate.wait(30)
            if name in self.failing:
                raise ModelLoadError(f"{name}/config.json is not valid JSON")
            engine = LLMEngine(load_model(self.model_dir, "cpu", Quantization.F32),
                               EngineConfig(device="cpu", quantization=Quantization.F32, max_num_seqs=4,
                                            max_model_len=4096))
            for adapter_name, path in adapters:
                try:
                    engine.add_lora(adapter_name, path)
                except RuvllmError:   # left out, as serve's loader does on a reload (skip_bad_adapters)
                    pass
            self.loops.append(EngineLoop(engine))
            return self.loops[-1]

        return load


@pytest.fixture
def pool_server(tiny_model_dir) -> Any:
    made: list[tuple[LiveServer, Loads]] = []

    def make(names: tuple[str, ...] = ("a", "b"), **settings: Any) -> tuple[LiveServer, Loads]:
        loads = Loads(tiny_model_dir)
        app_options = {key: settings.pop(key) for key in ("allow_runtime_lora",) if key in settings}
        app = create_app(None, ServerConfig(**app_options))
        specs = [ModelSpec((name, f"org/{name}"), loads.loader(name), path=loads.model_dir) for name in names]
        attach_models(app, specs, PoolSettings(**settings), max_num_seqs=4)
        live = LiveServer(ServerThread(app).start(), None, names)
        made.append((live, loads))
        return live, loads

    yield make
    for live, loads in made:
        live.stop()
        assert all(not loop.healthy for loop in loads.loops)   # stopping the app stopped every engine


def client_for(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)


def greedy(client: openai.OpenAI, model: str, max_tokens: int = 6) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def statuses(live: LiveServer) -> dict[str, str]:
    return {m["id"]: m["status"] for m in httpx.get(live.base_url + "/models").json()["data"]}


def wait_for(check: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)


def test_models_load_on_first_use_and_make_room_for_each_other(pool_server):
    live, loads = pool_server(max_loaded=1)
    health = httpx.get(live.url + "/health")
    assert health.status_code == 200 and health.json()["models"] == {"a": "unloaded", "b": "unloaded"}
    assert statuses(live) == {"a": "unloaded", "org/a": "unloaded", "b": "unloaded", "org/b": "unloaded"}
    client = client_for(live)
    first = greedy(client, "a")
    assert statuses(live)["a"] == "loaded" and statuses(live)["b"] == "unloaded"
    greedy(client, "org/b")
    wait_for(lambda: statuses(live) == {"a": "unloaded", "org/a": "unloaded", "b": "loaded", "org/b": "loaded"})
    assert greedy(client, "a") == first
    assert loads.calls == {"a": 2, "b": 1}
    assert [loop.healthy for loop in loads.loops] == [False, False, True]   # unloading stopped their threads
    metrics = httpx.get(live.url + "/metrics").text
    assert 'ruvllm_model_loads_total{model="a"} 2.0' in metrics
    assert 'ruvllm_model_unloads_total{model="b"} 1.0' in metrics
    assert 'ruvllm_model_loaded{model="a"} 1.0' in metrics and 'ruvllm_model_loaded{model="b"} 0.0' in metrics


def test_concurrent_requests_for_a_loading_model_share_one_load(pool_server):
    live, loads = pool_server()
    loads.gate = threading.Event()
    client = client_for(live)
    texts: list[str] = []
    workers = [threading.Thread(target=lambda: texts.append(greedy(client, "a"))) for _ in range(3)]
    for worker in workers:
        worker.start()
    wait_for(lambda: statuses(live)["a"] == "loading")
    loads.gate.set()
    for worker in workers:
        worker.join(30)
    assert len(texts) == 3 and len(set(texts)) == 1
    assert loads.calls == {"a": 1}


def start_stream(client: openai.OpenAI, model: str) -> Any:
    """A long streamed reply, its first chunk read: the model is held until the
    stream is closed (which cancels the rest), seconds before it could end by itself."""
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=4000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    return stream


def test_a_request_waits_while_the_only_slot_is_busy_then_takes_it(pool_server):
    live, loads = pool_server(max_loaded=1)
    client = client_for(live)
    stream = start_stream(client, "a")
    done: list[str] = []
    waiting = threading.Thread(target=lambda: done.append(greedy(client, "b")))
    waiting.start()
    time.sleep(0.5)
    assert not done and statuses(live)["b"] == "unloaded" and statuses(live)["a"] == "loaded"
    stream.close()   # the client leaves: its request ends, and the slot frees
    waiting.join(30)
    assert len(done) == 1 and statuses(live)["a"] == "unloaded"


def test_waiting_longer_than_the_slot_timeout_is_a_503_with_retry_after(pool_server):
    live, _ = pool_server(max_loaded=1, slot_timeout=0.3)
    client = client_for(live)
    stream = start_stream(client, "a")
    try:
        answer = httpx.post(live.base_url + "/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2})
    finally:
        stream.close()
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "5"
    error = answer.json()["error"]
    assert error["code"] == "models_busy" and "--models-max 1" in error["message"]


def test_a_failed_load_is_a_503_in_the_routes_shape_and_retried_later(pool_server):
    live, loads = pool_server(retry_after=0.5)
    loads.failing.add("b")
    client = client_for(live)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"] == "1"
    assert caught.value.body["code"] == "model_load_failed"
    assert caught.value.body["message"] == "The model 'b' failed to load: b/config.json is not valid JSON"
    anthropic = httpx.post(live.base_url + "/messages", json={
        "model": "b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert anthropic.status_code == 503 and "Retry-After" in anthropic.headers
    assert anthropic.json() == {"type": "error", "error": {
        "type": "overloaded_error", "message": "The model 'b' failed to load: b/config.json is not valid JSON"}}
    assert loads.calls == {"b": 1}   # within the retry window the error is answered at once
    assert statuses(live)["b"] == "failed" and httpx.get(live.url + "/health").status_code == 200
    assert greedy(client, "a")   # the other model is served meanwhile
    time.sleep(0.5)
    loads.failing.clear()
    assert greedy(client, "b") and loads.calls == {"a": 1, "b": 2}
    assert statuses(live)["b"] == "loaded"


def test_an_unload_asked_during_a_failed_load_does_not_unload_the_next_load(pool_server):
    """A helper's pass: Ollama's unload (`keep_alive: 0`, no messages) sent while a load
    that then failed ran stayed asked, and unloaded the next, good load at once."""
    live, loads = pool_server(retry_after=0.2)
    loads.failing.add("b")
    loads.gate = threading.Event()
    client = client_for(live)
    failed: list[int] = []

    def first_request() -> None:
        try:
            greedy(client, "b")
        except openai.APIStatusError as error:
            failed.append(error.status_code)

    worker = threading.Thread(target=first_request)
    worker.start()
    wait_for(lambda: statuses(live)["b"] == "loading")
    unload = httpx.post(live.url + "/api/chat", json={"model": "b", "messages": [], "keep_alive": 0}, timeout=30)
    assert unload.status_code == 200, unload.text
    loads.gate.set()
    worker.join(60)
    assert failed == [503] and statuses(live)["b"] == "failed"
    loads.failing.clear()
    time.sleep(0.3)
    assert greedy(client, "b")
    time.sleep(0.5)
    assert statuses(live)["b"] == "loaded"


def test_keep_alive_zero_unloads_a_model_when_its_last_request_ends(pool_server):
    live, loads = pool_server(keep_alive=0)
    greedy(client_for(live), "a")
    wait_for(lambda: statuses(live)["a"] == "unloaded")
    assert not loads.loops[0].healthy


def test_an_unknown_model_is_a_404_naming_every_model(pool_server):
    live, _ = pool_server()
    with pytest.raises(openai.NotFoundError) as caught:
        greedy(client_for(live), "nope")
    assert caught.value.body["message"] == ("The model 'nope' does not exist. This server serves: "
                                            "a, org/a, b, org/b.")


def test_a_runtime_adapter_comes_back_when_its_model_loads_again(pool_server, tiny_model_dir, tmp_path):
    live, loads = pool_server(max_loaded=1, allow_runtime_lora=True)
    adapter = build_lora_adapter(tiny_model_dir, tmp_path / "mlp", rank=4, targets=MLP, seed=3)
    client = client_for(live)
    base = greedy(client, "b")
    answer = httpx.post(live.base_url + "/load_lora_adapter", json={
        "lora_name": "sql", "lora_path": str(adapter), "model": "b"})
    assert answer.status_code == 200
    adapted = greedy(client, "sql")
    assert adapted != base
    assert {m["id"]: m["parent"] for m in httpx.get(live.base_url + "/models").json()["data"]}["sql"] == "b"
    greedy(client, "a")   # b makes room, and the adapter goes with it
    assert statuses(live)["sql"] == "unloaded"
    assert greedy(client, "sql") == adapted and loads.calls["b"] == 2
    onto_adapter = httpx.post(live.base_url + "/load_lora_adapter", json={
        "lora_name": "x", "lora_path": str(adapter), "model": "sql"})
    assert onto_adapter.status_code == 400 and onto_adapter.json()["error"]["param"] == "model"
    # Ollama's unload naming the adapter: it had been told the server was started with it
    unload = httpx.post(live.url + "/api/chat", json={"model": "sql", "messages": [], "keep_alive": 0}, timeout=30)
    assert unload.status_code == 400
    assert unload.json()["error"].startswith("'sql' is a LoRA adapter of b: unload b")
    greedy(client, "a")
    assert httpx.post(live.base_url + "/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    assert "sql" not in statuses(live)
    greedy(client, "b")
    assert "sql" not in statuses(live)   # unloaded for good: b came back without it


def test_a_request_waiting_for_a_load_gets_a_503_when_the_server_stops(pool_server):
    """Not yet admitted, so the shutdown would not wait for it: it is answered, not cut off."""
    live, loads = pool_server()
    loads.gate = threading.Event()
    answer: dict[str, Any] = {}

    def ask() -> None:
        answer["r"] = httpx.post(live.base_url + "/completions", json={"model": "a", "prompt": PROMPT,
                                                                     "max_tokens": 2}, timeout=30)

    asking = threading.Thread(target=ask)
    asking.start()
    wait_for(lambda: loads.calls.get("a") == 1)
    stopping = threading.Thread(target=live.stop)
    stopping.start()
    asking.join(20)
    loads.gate.set()
    stopping.join(30)
    assert answer["r"].status_code == 503 and answer["r"].json()["error"]["code"] == "shutting_down"


def test_one_name_loaded_onto_two_models_at_once_is_refused(pool_server, tiny_model_dir, tmp_path):
    live, loads = pool_server(allow_runtime_lora=True)
    adapter = build_lora_adapter(tiny_model_dir, tmp_path / "mlp", rank=4, targets=MLP, seed=3)
    loads.gate = threading.Event()   # the first load waits for its model: the name is taken meanwhile
    first: dict[str, Any] = {}
    loading = threading.Thread(target=lambda: first.update(r=httpx.post(live.base_url + "/load_lora_adapter", json={
        "lora_name": "twin", "lora_path": str(adapter), "model": "a"}, timeout=30)))
    loading.start()
    wait_for(lambda: loads.calls.get("a") == 1)
    second = httpx.post(live.base_url + "/load_lora_adapter", json={
        "lora_name": "twin", "lora_path": str(adapter), "model": "b"}, timeout=30)
    loads.gate.set()
    loading.join(30)
    assert first["r"].status_code == 200
    assert second.status_code == 400 and "already been loaded" in second.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(live.base_url + "/models").json()["data"]].count("twin") == 1
    blank = httpx.post(live.base_url + "/load_lora_adapter", json={"lora_name": "  ", "lora_path": str(adapter)})
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "lora_name"


def test_a_client_that_leaves_mid_load_leaves_engine_and_pool_agreeing(pool_server, tiny_model_dir, tmp_path):
    """The adapter the engine took is remembered: it comes back when its model loads again."""
    live, loads = pool_server(max_loaded=1, allow_runtime_lora=True)
    adapter = build_lora_adapter(tiny_model_dir, tmp_path / "mlp", rank=4, targets=MLP, seed=3)
    client = client_for(live)
    greedy(client, "b")
    engine = loads.loops[-1].engine
    add_lora = engine.add_lora

    def slow_add(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.5)
        return add_lora(*args, **kwargs)

    engine.add_lora = slow_add
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.base_url + "/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapter),
                                                                "model": "b"}, timeout=0.5)
    wait_for(lambda: "sql" in statuses(live))
    adapted = greedy(client, "sql")
    greedy(client, "a")   # b makes room, and comes back with the adapter
    assert greedy(client, "sql") == adapted and loads.calls["b"] == 2


def test_an_adapter_gone_bad_is_dropped_and_its_model_still_loads(pool_server, tiny_model_dir, tmp_path):
    import shutil

    live, loads = pool_server(max_loaded=1, allow_runtime_lora=True)
    adapter = build_lora_adapter(tiny_model_dir, tmp_path / "mlp", rank=4, targets=MLP, seed=3)
    client = client_for(live)
    assert httpx.post(live.base_url + "/load_lora_adapter", json={
        "lora_name": "gone", "lora_path": str(adapter), "model": "b"}).status_code == 200
    greedy(client, "gone")
    shutil.rmtree(adapter)
    greedy(client, "a")   # b is unloaded; its adapter's directory is gone
    assert greedy(client, "b")   # b loads without it (serve's loader: skip_bad_adapters) ...
    greedy(client, "a")
    assert "gone" not in statuses(live)   # ... and the pool forgot it: not listed, not tried again
    assert loads.calls["b"] == 2


def engine_counter(live: LiveServer, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(live.url + "/metrics").text)}
    return families[name].samples[0].value


def test_engine_counters_never_go_back_when_a_model_unloads(pool_server):
    """/metrics sums the loaded engines' counters: an unload used to take its engine's
    away (Prometheus reads a drop as a reset), and with none loaded the gauges vanished."""
    live, _ = pool_server(names=("a", "b"), max_loaded=1)
    assert engine_counter(live, "ruvllm_engine_steps") == 0
    assert engine_counter(live, "ruvllm_num_requests_running") == 0   # present before any load
    client = client_for(live)
    greedy(client, "a", max_tokens=20)
    after_a = engine_counter(live, "ruvllm_engine_steps")
    queries_a = engine_counter(live, "ruvllm_prefix_cache_queries")
    assert after_a >= 20
    greedy(client, "b", max_tokens=3)   # a unloads to make room
    wait_for(lambda: statuses(live)["a"] == "unloaded")
    assert engine_counter(live, "ruvllm_engine_steps") >= after_a + 3
    assert engine_counter(live, "ruvllm_prefix_cache_queries") > queries_a
    assert engine_counter(live, "ruvllm_kv_cache_blocks_used") == 0


def test_engine_counters_never_go_back_while_scrapes_race_the_unloads(pool_server):
    """An unload took its engine off the list before its counts joined the retired
    ones (an executor hop later), and a scrape that awaited an engine could count one
    twice: a counter read in a tight loop went back at most unloads (a helper's pass)."""
    live, loads = pool_server(keep_alive=0)   # each request's end unloads its model
    client = client_for(live)
    seen: list[float] = []
    done = threading.Event()

    def scrape() -> None:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            from prometheus_client.parser import text_string_to_metric_families

            while not done.is_set():
                families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
                seen.append(families["ruvllm_engine_steps"].samples[0].value)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for _ in range(8):
            greedy(client, "a", max_tokens=4)
            wait_for(lambda: statuses(live)["a"] == "unloaded")
    finally:
        done.set()
        scraper.join(30)
    assert loads.calls["a"] == 8 and len(seen) > 20
    assert all(later >= earlier for earlier, later in zip(seen, seen[1:])), seen
