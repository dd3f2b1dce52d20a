"""Error answers over raw HTTP: status, OpenAI's body shape, the offending `param`."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from ruvllm_cli.testing.api_errors import assert_error

pytestmark = pytest.mark.timeout(60)

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def post_chat(http, **body):
    body.setdefault("model", "tiny")
    return http.post("/v1/chat/completions", json=body)


def test_malformed_json_is_400(http):
    response = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                         headers={"Content-Type": "application/json"})
    error = assert_error(response, 400, code="invalid_json", contains="could not parse the JSON body")
    assert error["type"] == "invalid_request_error"


def test_a_number_too_long_to_read_is_400_without_pythons_advice(http):
    body = b'{"model": "tiny", "prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}"
    error = assert_error(http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}),
                         400, code="invalid_json", contains="a number has more digits than the 4300 we read")
    assert "sys." not in error["message"]


@pytest.mark.parametrize("body, message", [(b"", "empty"), (b"[1, 2]", "must be a JSON object")])
def test_body_must_be_an_object(http, body, message):
    assert_error(http.post("/v1/completions", content=body), 400, contains=message)


def test_missing_messages_and_prompt(http):
    assert_error(post_chat(http), 400, "messages", "missing_required_parameter")
    assert_error(http.post("/v1/completions", json={"model": "tiny"}), 400, "prompt", "missing_required_parameter")
    assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 400, "model", "missing_required_parameter")
    assert_error(post_chat(http, model="", messages=HELLO), 400, "model", "missing_required_parameter")


@pytest.mark.parametrize("field, value, param, code", [
    ("max_tokens", "5", "max_tokens", "invalid_type"),
    ("max_tokens", True, "max_tokens", "invalid_type"),
    ("max_tokens", 0, "max_tokens", "invalid_value"),
    ("max_completion_tokens", 1.5, "max_completion_tokens", "invalid_type"),
    ("temperature", "hot", "temperature", "invalid_type"),
    ("temperature", 2.5, "temperature", "invalid_value"),
    ("top_p", 0, "top_p", "invalid_value"),
    ("n", 0, "n", "invalid_value"),
    ("presence_penalty", -3, "presence_penalty", "invalid_value"),
    ("frequency_penalty", [1], "frequency_penalty", "invalid_type"),
    ("stop", 5, "stop", "invalid_type"),
    ("stop", ["a", "b", "c", "d", "e"], "stop", "invalid_value"),
    ("stop", ["a", 2], "stop[1]", "invalid_type"),   # was "expected ... an array of strings, but got an array"
    ("seed", "x", "seed", "invalid_type"),
    ("stream", "yes", "stream", "invalid_type"),
    ("stream_options", {"include_usage": 1}, "stream_options.include_usage", "invalid_type"),
    ("logprobs", 1, "logprobs", "invalid_type"),
    ("top_logprobs", 21, "top_logprobs", "invalid_value"),
    ("messages", "hello", "messages", "invalid_type"),
    ("messages", [], "messages", None),
    ("messages", [{"role": "robot", "content": "x"}], "messages[0].role", "invalid_value"),
    ("messages", [{"role": "user"}], "messages[0].content", "missing_required_parameter"),
    ("messages", [{"role": "user", "content": 3}], "messages[0].content", "invalid_type"),
])
def test_wrong_chat_fields_name_their_param(http, field, value, param, code):
    body = {"messages": HELLO, field: value}
    assert_error(post_chat(http, **body), 400, param, code)


def test_non_text_content_parts_are_refused(http):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert_error(post_chat(http, messages=messages), 400, "messages[0].content[1].type",
                 contains="only text content parts")


def test_top_logprobs_needs_logprobs(http):
    assert_error(post_chat(http, messages=HELLO, top_logprobs=2), 400, "top_logprobs")


def test_text_format_and_empty_tools_are_plain_requests(http):
    ok = post_chat(http, messages=HELLO, max_tokens=2, response_format={"type": "text"}, tools=[])
    assert ok.status_code == 200


def test_context_length_exceeded(http, server):
    limit = server.engine(lambda e: e.max_model_len)
    error = assert_error(post_chat(http, messages=HELLO, max_tokens=limit), 400, "messages",
                         "context_length_exceeded", f"maximum context length is {limit} tokens")
    assert "in the completion" in error["message"]
    too_long = [10 + i % 400 for i in range(limit)]
    assert_error(http.post("/v1/completions", json={"model": "tiny", "prompt": too_long}), 400, "prompt",
                 "context_length_exceeded")


@pytest.mark.parametrize("path, field", [("/v1/chat/completions", "max_tokens"),
                                         ("/v1/chat/completions", "max_completion_tokens"),
                                         ("/v1/completions", "max_tokens")])
def test_a_max_tokens_beyond_the_whole_context_is_named_as_the_culprit(http, server, path, field):
    limit = server.engine(lambda e: e.max_model_len)
    body = {"model": "tiny", field: 10**6, **({"messages": HELLO} if "chat" in path else {"prompt": "Hi"})}
    assert_error(http.post(path, json=body), 400, field, "invalid_value",
                 f"Invalid value for '{field}': must leave room for the prompt in this model's context of {limit} "
                 "tokens (got 1000000).")


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "max_tokens", 4.0), ("/v1/chat/completions", "max_completion_tokens", 4.0),
    ("/v1/chat/completions", "n", 2.0), ("/v1/chat/completions", "seed", 7.0), ("/v1/chat/completions", "top_k", 5.0),
    ("/v1/chat/completions", "top_logprobs", 2.0), ("/v1/completions", "max_tokens", 4.0),
    ("/v1/completions", "logprobs", 1.0), ("/v1/completions", "best_of", 1.0), ("/v1/completions", "n", 1e3),
])
def test_an_integral_float_is_not_an_integer(http, path, field, value):
    """OpenAI refuses 4.0 where it takes an integer; so do we (4.0 was taken as 4)."""
    body = {"model": "tiny", field: value, **({"messages": HELLO} if "chat" in path else {"prompt": "Hi"})}
    assert_error(http.post(path, json=body), 400, field, "invalid_type",
                 f"Invalid type for '{field}': expected an integer, but got a number instead.")
    assert_error(http.post("/v1/completions", json={"model": "tiny", "prompt": [1.0, 2]}), 400, "prompt[0]",
                 "invalid_type")


def test_bad_prompts(http):
    assert_error(http.post("/v1/completions", json={"model": "tiny", "prompt": []}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={"model": "tiny", "prompt": [[1, 2], "x", 3]}), 400,
                 "prompt[2]", "invalid_type")
    assert_error(http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 99999]}), 400, "prompt",
                 contains="outside the vocabulary [0, 512)")
    assert_error(http.post("/v1/completions", json={"model": "tiny", "prompt": ""}), 400, "prompt",
                 contains="empty")


def test_unknown_model_is_404(http):
    error = assert_error(post_chat(http, model="gpt-4o", messages=HELLO), 404, "model", "model_not_found",
                         "'gpt-4o' does not exist")
    assert error["type"] == "invalid_request_error"
    assert_error(post_chat(http, model="TINY", messages=HELLO), 404, "model")   # names are case-sensitive


def test_unknown_route_and_wrong_method(http):
    assert_error(http.get("/v1/nothing"), 404, contains="Unknown route: GET /v1/nothing")
    response = http.get("/v1/chat/completions")
    assert_error(response, 405)
    assert response.headers["Allow"] == "POST"


def test_api_key_guards_every_route_but_health(make_server):
    live = make_server(api_key="s3cret")
    with httpx.Client(base_url=live.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/v1/nothing"):
            error = assert_error(http.get(path), 401, code="invalid_api_key", contains="Missing API key")
            assert error["type"] == "invalid_request_error"
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer s3cret-not"})
        assert_error(wrong, 401, code="invalid_api_key", contains="Incorrect API key")
        assert wrong.headers["WWW-Authenticate"] == "Bearer"
        assert_error(http.get("/v1/models", headers={"Authorization": "Basic s3cret"}), 401)
        good = {"Authorization": "Bearer s3cret"}
        assert http.get("/v1/models", headers=good).status_code == 200
        ok = http.post("/v1/chat/completions", headers=good, json={"model": "tiny", "messages": HELLO,
                                                                   "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_body_over_the_cap_is_413(make_server):
    live = make_server(max_body_size=2048)
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 4096}]}
    with httpx.Client(base_url=live.url, timeout=30) as http:
        assert_error(http.post("/v1/chat/completions", json=big), 413, code="request_too_large",
                     contains="limit is 2048 bytes")

        def chunked():   # no Content-Length: aiohttp's own cap must answer in our shape too
            data = json.dumps(big).encode()
            for start in range(0, len(data), 1024):
                yield data[start:start + 1024]

        assert_error(http.post("/v1/chat/completions", content=chunked()), 413, code="request_too_large")
        small = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
        assert small.status_code == 200


def test_queue_full_is_429_with_retry_after(make_server):
    live = make_server(engine={"max_num_seqs": 1}, max_queue=0)
    long = {"model": "tiny", "messages": HELLO, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=long) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")
            busy = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
            error = assert_error(busy, 429, code="queue_full", contains="busy")
            assert error["type"] == "rate_limit_exceeded"
            assert busy.headers["Retry-After"] == "1"
        live.wait_idle()   # closing the first stream cancelled it
        again = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
        assert again.status_code == 200
    live.assert_clean()


def test_a_waiting_request_is_admitted_within_the_queue(make_server):
    live = make_server(engine={"max_num_seqs": 1}, max_queue=1)
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 40, "ignore_eos": True}
    results: list[int] = []

    def send() -> None:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            results.append(client.post("/v1/chat/completions", json=body).status_code)

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [200, 200]
    live.assert_clean()


def test_a_small_body_cannot_ask_for_thousands_of_sequences(http):
    amplified = {"model": "tiny", "prompt": ["Hi"] * 100, "n": 128, "max_tokens": 1}
    assert len(json.dumps(amplified)) < 1024
    assert_error(http.post("/v1/completions", json=amplified), 400, "prompt", "invalid_value",
                 "'prompt' holds 100 prompts; this server takes at most 16 in one request.")
    assert_error(http.post("/v1/completions", json={**amplified, "prompt": ["Hi"] * 8, "n": 4}), 400, "n",
                 "invalid_value", "asks for 32 sequences (8 prompts x n=4); this server generates at most 16")
    assert_error(post_chat(http, messages=HELLO, n=17), 400, "n", "invalid_value", "asks for 17 sequences (n=17)")
    # Nothing was admitted: every other client is still served at once.
    within = http.post("/v1/completions", json={**amplified, "prompt": ["Hi"] * 4, "n": 4})
    assert within.status_code == 200 and len(within.json()["choices"]) == 16


def test_the_request_caps_follow_the_server_settings(make_server):
    from ruvllm_cli.server.protocol import RequestLimits

    live = make_server(limits=RequestLimits(max_prompts=2, max_sequences=64))
    with httpx.Client(base_url=live.url, timeout=30) as http:
        body = {"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 1}
        assert_error(http.post("/v1/completions", json=body), 400, "prompt", contains="at most 2 in one request")
        # 64 sequences are allowed, but the server holds only 16 + 64 = 80 ...
        assert http.post("/v1/completions", json={**body, "prompt": ["a", "b"], "n": 32}).status_code == 200


def test_a_request_bigger_than_the_whole_capacity_is_400_even_when_idle(make_server):
    live = make_server(engine={"max_num_seqs": 1}, max_queue=1)
    with httpx.Client(base_url=live.url, timeout=30) as http:
        assert_error(post_chat(http, messages=HELLO, n=3, max_tokens=1), 400, "n",
                     contains="this server generates at most 2 for one request")
        assert_error(http.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b", "c"]}), 400,
                     "prompt", contains="asks for 3 sequences")
        assert post_chat(http, messages=HELLO, n=2, max_tokens=1).status_code == 200
    live.assert_clean()


def test_admission_refuses_what_never_fits_and_what_does_not_fit_now():
    from ruvllm_cli.server.errors import ApiError
    from ruvllm_cli.server.state import Admission

    admission = Admission()
    admission.capacity = 4
    with pytest.raises(ApiError) as never, admission.reserve(5, "prompt"):
        pass
    assert (never.value.status, never.value.param) == (400, "prompt")
    with admission.reserve(3):
        with pytest.raises(ApiError) as busy, admission.reserve(2):
            pass
        assert busy.value.status == 429 and busy.value.headers == {"Retry-After": "1"}
        with admission.reserve(1):
            assert admission.in_flight == 4
    assert admission.in_flight == 0


def test_a_request_that_fits_but_not_now_is_429(make_server):
    live = make_server(engine={"max_num_seqs": 2}, max_queue=1)
    long = {"model": "tiny", "messages": HELLO, "max_tokens": 900, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.Client(base_url=live.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=long) as first:
            lines = first.iter_lines()   # kept: dropping the iterator closes the stream
            assert next(lines).startswith("data: ")
            busy = post_chat(http, messages=HELLO, n=2, max_tokens=1)
            assert_error(busy, 429, code="queue_full", contains="busy")
            assert busy.headers["Retry-After"] == "1"
        live.wait_idle()
    live.assert_clean()


def test_an_error_that_quotes_a_lone_surrogate_still_serialises():
    from ruvllm_cli.server.errors import ApiError

    response = ApiError(404, "The model '\ud800' does not exist.", param="model").response()
    assert json.loads(response.body) == {"error": {"message": "The model '\ud800' does not exist.",
                                                   "type": "invalid_request_error", "param": "model", "code": None}}


@pytest.mark.parametrize("raw, param, contains", [
    (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "Hi"}]}', "model", "lone UTF-16 surrogate"),
    (b'{"model": "tiny", "prompt": "a\\udfffb"}', "prompt", "lone UTF-16 surrogate (at offset 1)"),
    (b'{"model": "tiny", "prompt": ["ok", "a\\u0000b\\udc00"]}', "prompt[1]", "surrogate (at offset 3)"),
    (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 200 + b"]" * 200 + b"}", None, "nested too deeply (at most 128"),
])
def test_text_we_cannot_tokenize_and_absurd_nesting_are_400(http, raw, param, contains):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert_error(response, 400, param, contains=contains)


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f", "parameters": {"type": "object"}}]),
                                          ("function_call", {"name": "f"}), ("function_call", "auto")])
def test_openai_s_deprecated_function_fields_are_refused_not_ignored(http, field, value):
    """They had been ignored: the model never saw the functions and a forced call was
    dropped, under a 200 (a helper's pass)."""
    response = post_chat(http, messages=HELLO, **{field: value})
    assert_error(response, 400, field, "unsupported_parameter")
    assert "deprecated" in response.json()["error"]["message"]


def test_empty_deprecated_function_fields_are_no_request_for_functions(http):
    assert post_chat(http, messages=HELLO, functions=[], function_call=None, max_tokens=2).status_code == 200


def test_a_route_asked_with_a_method_it_does_not_take_keeps_its_metrics_label(http):
    """A GET of /v1/chat/completions (405) and a CORS preflight's OPTIONS had been
    counted as endpoint="unmatched" with the unknown paths."""
    assert http.get("/v1/chat/completions").status_code == 405
    assert http.get("/v1/no-such-route").status_code == 404
    metrics = http.get("/metrics").text
    assert 'ruvllm_http_requests_total{endpoint="/v1/chat/completions",status="405"}' in metrics
    assert 'ruvllm_http_requests_total{endpoint="unmatched",status="404"}' in metrics
