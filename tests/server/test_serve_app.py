"""The app around its engine: health while loading, metrics, CORS, graceful shutdown."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from ruvllm_cli.server import attach_engine

pytestmark = pytest.mark.timeout(60)

HELLO = [{"role": "user", "content": "Hello"}]


def test_health_is_503_until_the_engine_slot_is_filled(make_server):
    live = make_server(attach=False)
    with httpx.Client(base_url=live.url, timeout=30) as http:
        loading = http.get("/health")
        assert loading.status_code == 503 and loading.json() == {"status": "loading"}
        api = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO})
        assert api.status_code == 503 and api.json()["error"]["code"] == "model_loading"
        assert api.headers["Retry-After"] == "5"
        live.thread.call(lambda: attach_engine(live.thread.app, live.engine_loop, ["tiny"]))
        ready = http.get("/health")
        assert ready.status_code == 200
        assert ready.json()["status"] == "ok" and ready.json()["model"] == "tiny"
        assert ready.json()["uptime_s"] >= 0
        assert http.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_metrics_expose_requests_tokens_latency_and_engine_state(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        ok = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 3})
        assert ok.status_code == 200
        http.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO})
        response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    text = response.text
    for name in ("ruvllm_http_requests_total", "ruvllm_prompt_tokens_total", "ruvllm_generation_tokens_total",
                 "ruvllm_time_to_first_token_seconds_bucket", "ruvllm_e2e_request_latency_seconds_bucket",
                 "ruvllm_num_requests_running", "ruvllm_num_requests_waiting", "ruvllm_kv_cache_blocks_used",
                 "ruvllm_kv_cache_blocks_total", "ruvllm_kv_cache_usage_ratio", "ruvllm_prefix_cache_hit_rate",
                 "ruvllm_prefix_cache_queries_total", "ruvllm_prefix_cache_hits_total",
                 "ruvllm_prefix_cache_blocks", "ruvllm_prefix_cache_evictions_total",
                 "ruvllm_num_preemptions_total", "ruvllm_engine_steps_total", "ruvllm_http_requests_in_flight"):
        assert f"\n{name}" in text, name
    assert 'ruvllm_http_requests_total{endpoint="/v1/chat/completions",status="200"}' in text
    assert 'ruvllm_http_requests_total{endpoint="/v1/chat/completions",status="404"}' in text
    total = server.engine(lambda e: e.block_manager.num_blocks)
    assert f"ruvllm_kv_cache_blocks_total {float(total)}" in text


def test_each_app_has_its_own_registry(server, make_server):
    other = make_server()
    assert other.state.metrics.registry is not server.state.metrics.registry
    httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 1})
    assert 'endpoint="/v1/chat/completions"' not in httpx.get(other.url + "/metrics").text


def test_cors_is_off_unless_origins_are_named(server, make_server):
    origin = {"Origin": "http://app.example"}
    plain = httpx.get(server.url + "/v1/models", headers=origin)
    assert "Access-Control-Allow-Origin" not in plain.headers
    live = make_server(cors_origins=("http://app.example",), api_key="k")
    preflight = httpx.options(live.url + "/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    allowed = httpx.get(live.url + "/v1/models", headers={**origin, "Authorization": "Bearer k"})
    assert allowed.headers["Access-Control-Allow-Origin"] == "http://app.example"
    stranger = httpx.options(live.url + "/v1/models", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "GET"})
    assert stranger.status_code == 403
    assert "Access-Control-Allow-Origin" not in stranger.headers


def test_shutdown_lets_in_flight_requests_finish(make_server):
    live = make_server(shutdown_timeout=10)
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 150, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            stream = response.iter_lines()
            lines.append(next(stream))
            stopper = threading.Thread(target=live.thread.stop)
            stopper.start()
            lines.extend(stream)
            stopper.join(20)
    lines = [line for line in lines if line]
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(lines)
    with pytest.raises(httpx.ConnectError):
        httpx.get(live.url + "/health", timeout=5)
    live.engine(lambda e: e.check_integrity())
    assert not live.engine(lambda e: e.has_unfinished)


def test_shutdown_ends_what_outlives_the_timeout_cleanly(make_server):
    live = make_server(shutdown_timeout=0.5, engine={"max_model_len": 4096})
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    plain: list[httpx.Response] = []
    with httpx.Client(base_url=live.url, timeout=30) as http:
        waiter = threading.Thread(target=lambda: plain.append(http.post("/v1/completions", json={
            "model": "tiny", "prompt": "Once", "max_tokens": 4000, "ignore_eos": True})))
        waiter.start()
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            stream = response.iter_lines()
            first = next(stream)
            while live.state.admission.requests < 2:
                time.sleep(0.01)
            started = time.monotonic()
            live.thread.stop()
            stopped = time.monotonic() - started
            lines = [first, *(line for line in stream if line)]   # a complete chunked body
        waiter.join(10)
    assert stopped < 0.5 + 0.5
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert plain[0].status_code == 503 and plain[0].json()["error"] == {
        "message": "The request was cancelled because the server is shutting down.", "type": "service_unavailable",
        "param": None, "code": "shutting_down"}
    deadline = time.monotonic() + 10
    while live.engine(lambda e: e.has_unfinished) and time.monotonic() < deadline:
        time.sleep(0.02)
    live.engine(lambda e: e.check_integrity())
    assert live.engine(lambda e: e.block_manager.num_free_blocks == e.block_manager.num_blocks)


def test_an_internal_error_is_a_500_without_a_traceback(make_server, monkeypatch, caplog):
    from ruvllm_cli.server import engine_client

    def explode(engine):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine_client, "read_engine_snapshot", explode)
    live = make_server()
    with caplog.at_level("ERROR", logger="ruvllm.server"):
        response = httpx.get(live.url + "/metrics")
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "The server had an error while processing your request.",
                                         "type": "server_error", "param": None, "code": None}}
    assert "internal error on GET /metrics: RuntimeError: boom" in caplog.text


def test_an_internal_error_mid_stream_is_an_error_event_and_one_short_log_line(make_server, monkeypatch, caplog):
    """A helper's pass with --replicas: a replica Ray's memory monitor killed raised an
    error the stream did not catch, and the last-resort 500 was written into the
    stream's body ("illegal chunk header"), with a 40 MB log line (Ray's process table)."""
    from ruvllm_cli.server import routes

    async def fail(sse, *args, **kwargs):
        await sse.send({"id": "x", "object": "chat.completion.chunk", "choices": []})
        raise RuntimeError("x" * 10_000 + "\nthe rest of a process table")

    monkeypatch.setattr(routes, "send_outputs", fail)
    live = make_server()
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 5, "stream": True}
    with caplog.at_level("ERROR", logger="ruvllm.server"):
        response = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
    [line] = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
    assert line.startswith("internal error on POST /v1/chat/completions: RuntimeError: xxx") and len(line) < 600
    live.wait_idle()


def test_a_write_to_a_client_that_left_mid_stream_is_a_quiet_499(make_server, monkeypatch, caplog):
    """aiohttp's ClientConnectionResetError (a write reaching the closing transport of a
    client that left) had been caught as an internal error: logged with a traceback under
    -v, 19 of 300 streamed /v1/messages whose clients reset the connection."""
    from ruvllm_cli.server import routes

    async def gone(sse, *args, **kwargs):
        await sse.send({"id": "x", "object": "chat.completion.chunk", "choices": []})
        raise ConnectionResetError("Cannot write to closing transport")

    monkeypatch.setattr(routes, "send_outputs", gone)
    live = make_server()
    registry = live.state.metrics.registry
    labels = {"endpoint": "/v1/chat/completions", "status": "499"}
    before = registry.get_sample_value("ruvllm_http_requests_total", labels) or 0
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 5, "stream": True}
    with caplog.at_level("INFO"):
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)
    assert not [r.getMessage() for r in caplog.records if "internal error" in r.getMessage() or r.exc_info]
    assert registry.get_sample_value("ruvllm_http_requests_total", labels) == before + 1
    live.wait_idle()


def test_in_flight_metrics_count_requests_and_their_sequences_apart(make_server):
    live = make_server()
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 900, "ignore_eos": True, "stream": True, "n": 3}
    with httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()   # kept: dropping the iterator closes the stream
            assert next(lines).startswith("data: ")
            text = http.get("/metrics").text
        live.wait_idle()
        after = http.get("/metrics").text
    assert "\nruvllm_http_requests_in_flight 1.0\n" in text
    assert "\nruvllm_sequences_in_flight 3.0\n" in text
    assert "\nruvllm_http_requests_in_flight 0.0\n" in after and "\nruvllm_sequences_in_flight 0.0\n" in after


def test_a_chat_without_max_tokens_stops_at_the_server_default(make_server):
    live = make_server(chat_max_tokens=5)
    with httpx.Client(base_url=live.url, timeout=30) as http:
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "ignore_eos": True})
        completion = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "ignore_eos": True})
        asked = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "ignore_eos": True,
                                                        "max_tokens": 7})
        response = http.post("/v1/responses", json={"model": "tiny", "input": HELLO, "ignore_eos": True})
        models = http.get("/v1/models").json()["data"]
    assert chat.json()["usage"]["completion_tokens"] == 5 and chat.json()["choices"][0]["finish_reason"] == "length"
    assert completion.json()["usage"]["completion_tokens"] == 16   # OpenAI's default for completions
    assert asked.json()["usage"]["completion_tokens"] == 7
    assert response.json()["usage"]["output_tokens"] == 5 and response.json()["status"] == "incomplete"
    assert models[0]["max_tokens_default"] == {"/v1/chat/completions": 5, "/v1/completions": 16, "/v1/responses": 5}


def test_the_chat_default_is_1024_tokens(server):
    model = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert model["max_tokens_default"] == {"/v1/chat/completions": 1024, "/v1/completions": 16,
                                           "/v1/responses": 1024}


def slow_snapshot(seconds: float):
    from ruvllm_cli.server.metrics import read_engine_snapshot

    def read(engine):
        time.sleep(seconds)   # on the engine thread, as a long step would hold it
        return read_engine_snapshot(engine)

    return read


def scrape_in_background(url: str) -> tuple[threading.Thread, list]:
    answers: list = []

    def scrape() -> None:
        try:
            answers.append(httpx.get(url + "/metrics", timeout=30))
        except httpx.TransportError as error:
            answers.append(error)

    thread = threading.Thread(target=scrape)
    thread.start()
    return thread, answers


def test_shutdown_waits_for_a_metrics_scrape_in_flight(make_server, monkeypatch):
    from ruvllm_cli.server import engine_client

    monkeypatch.setattr(engine_client, "read_engine_snapshot", slow_snapshot(1.0))
    live = make_server(shutdown_timeout=5)
    thread, answers = scrape_in_background(live.url)
    time.sleep(0.3)   # the scrape waits on the engine thread
    started = time.monotonic()
    live.thread.stop()
    stopped = time.monotonic() - started
    thread.join(10)
    assert isinstance(answers[0], httpx.Response), answers   # before: the connection was cut
    assert answers[0].status_code == 200 and "ruvllm_kv_cache_usage" in answers[0].text
    assert 0.4 < stopped < 5


def test_a_metrics_scrape_that_outlives_the_shutdown_timeout_gets_a_503(make_server, monkeypatch):
    from ruvllm_cli.server import engine_client

    monkeypatch.setattr(engine_client, "read_engine_snapshot", slow_snapshot(3.0))
    live = make_server(shutdown_timeout=0.3)
    thread, answers = scrape_in_background(live.url)
    time.sleep(0.3)
    started = time.monotonic()
    live.thread.stop()
    stopped = time.monotonic() - started
    thread.join(10)
    assert isinstance(answers[0], httpx.Response), answers
    assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "shutting_down"
    assert stopped < 0.3 + 1


def generated_so_far(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    return families["ruvllm_generation_tokens"].samples[0].value


def test_generated_tokens_are_counted_as_they_come(server):
    """Not all at once when the request ends: a scrape in mid-stream sees its tokens."""
    before = generated_so_far(server.url)
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: {")
            if events == 10:
                assert generated_so_far(server.url) - before >= 10
        assert events >= 10
    assert generated_so_far(server.url) - before == 40


def test_ping_and_version_are_vllm_s_routes(make_server):
    """/ping is /health under vLLM's (SageMaker's) name, public like it; /version needs the key."""
    from ruvllm_cli import __version__

    live = make_server(api_key="sk-test")
    health = httpx.get(live.url + "/health").json()
    for method in ("GET", "POST"):
        ping = httpx.request(method, live.url + "/ping")
        assert ping.status_code == 200 and ping.json()["status"] == health["status"] == "ok"
    assert httpx.get(live.url + "/version").status_code == 401
    version = httpx.get(live.url + "/version", headers={"Authorization": "Bearer sk-test"})
    assert version.json() == {"version": __version__}
