"""Ollama's API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version)
through the official `ollama` client and LangChain's ChatOllama over the real socket:
the same engine path as chat completions (the same prompt tokens and greedy text),
Ollama's objects and NDJSON stream, measured durations, tool calls with object
arguments, `format` constraints, `think`, load/unload requests, Ollama's error shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import openai
import pytest

from ruvllm_cli import __version__
from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import FinishReason, RequestTimings
from ruvllm_cli.engine.tool_parsers import get_parser
from ruvllm_cli.server.bridge import Choice
from ruvllm_cli.server.ollama_api.protocol import parse_keep_alive
from ruvllm_cli.server.ollama_api.responses import Clock, OllamaFormat
from ruvllm_cli.server.tool_output import ToolReplies
from tests.server.test_model_pool import pool_server, wait_for  # noqa: F401 - pool_server is a fixture
from tests.server.test_tools import TOOLS, WEATHER

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]
GREEDY = {"temperature": 0, "num_predict": 12}


@pytest.fixture
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


@pytest.fixture
def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def lines(server, path, body) -> list[dict]:
    """A streamed answer off the wire: every line one JSON object."""
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in response.iter_lines() if line]


def test_chat_is_the_chat_route_s_reply(client, openai_client, server):
    reply = client.chat(model=server.model, messages=HELLO, options=GREEDY, stream=False)
    same = openai_client.chat.completions.create(model=server.model, messages=HELLO, temperature=0, max_tokens=12)
    assert reply.message.role == "assistant"
    assert reply.message.content == same.choices[0].message.content
    assert reply.done and reply.done_reason == "length"
    assert reply.prompt_eval_count == same.usage.prompt_tokens
    assert reply.eval_count == same.usage.completion_tokens == 12
    # measured, in nanoseconds: the parts within the whole
    assert 0 < reply.prompt_eval_duration < reply.total_duration
    assert 0 < reply.eval_duration < reply.total_duration
    assert 0 <= reply.load_duration < reply.total_duration


def test_a_streamed_chat_reassembles_to_the_whole_reply(client, server):
    whole = client.chat(model=server.model, messages=HELLO, options=GREEDY, stream=False)
    parts = list(client.chat(model=server.model, messages=HELLO, options=GREEDY, stream=True))
    assert all(not part.done for part in parts[:-1]) and parts[-1].done
    assert "".join(part.message.content for part in parts) == whole.message.content
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 12
    raw = lines(server, "/api/chat", {"model": server.model, "messages": HELLO, "options": GREEDY})
    assert len(raw) == len(parts) and raw[-1]["done"] is True and "total_duration" in raw[-1]


def test_generate_renders_the_prompt_through_the_template_unless_raw(client, openai_client, server):
    prompt = "Write a haiku."
    reply = client.generate(model=server.model, prompt=prompt, system="Be brief.", options=GREEDY)
    chat = client.chat(model=server.model, messages=[{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": prompt}], options=GREEDY)
    assert reply.response == chat.message.content and reply.done_reason == "length"
    assert reply.prompt_eval_count == chat.prompt_eval_count
    raw = client.generate(model=server.model, prompt=prompt, raw=True, options=GREEDY)
    completion = openai_client.completions.create(model=server.model, prompt=prompt, temperature=0, max_tokens=12)
    assert raw.response == completion.choices[0].text
    assert raw.prompt_eval_count == completion.usage.prompt_tokens
    streamed = list(client.generate(model=server.model, prompt=prompt, raw=True, options=GREEDY, stream=True))
    assert "".join(part.response for part in streamed) == raw.response


def test_options_map_onto_sampling(client, server):
    seeded = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "seed": 7, "num_predict": 10, "repeat_penalty": 1.1}
    first = client.chat(model=server.model, messages=HELLO, options=seeded)
    again = client.chat(model=server.model, messages=HELLO, options=seeded)
    assert first.message.content == again.message.content and first.eval_count == 10
    # whole floats where integers go, as Ollama converts them
    floats = client.chat(model=server.model, messages=HELLO, options={**seeded, "top_k": 20.0, "num_predict": 10.0})
    assert floats.message.content == first.message.content
    # options of Ollama's own runner change nothing
    tuned = client.chat(model=server.model, messages=HELLO, options={**seeded, "num_ctx": 8192, "num_gpu": 99,
                                                                     "mirostat": 2, "num_thread": 4})
    assert tuned.message.content == first.message.content
    # a stop string ends the reply before it
    whole = client.chat(model=server.model, messages=HELLO, options={"temperature": 0, "num_predict": 24})
    cut = next(i for i in range(4, len(whole.message.content)) if not whole.message.content[i].isspace())
    stop = whole.message.content[cut:cut + 2]
    stopped = client.chat(model=server.model, messages=HELLO,
                          options={"temperature": 0, "num_predict": 24, "stop": [stop]})
    assert stopped.done_reason == "stop"
    assert whole.message.content.startswith(stopped.message.content) and stop not in stopped.message.content


def test_repeat_last_n_is_the_penalties_window():
    """The penalties look at the last repeat_last_n tokens (64 unless given), as
    Ollama's llama.cpp runner; 0 turns them off, the model's recommendation too; -1 is
    the whole context. ruvllm's repetition_penalty had read the whole history."""
    from ruvllm_cli.server.ollama_api.protocol import REPEAT_LAST_N, WHOLE_CONTEXT, parse_chat

    def fields(**options):
        return parse_chat({"model": "m", "messages": HELLO, "options": options}).sampling

    assert fields(repeat_penalty=1.1).penalty_last_n == REPEAT_LAST_N == 64
    assert fields(repeat_last_n=8).params(16, 0).penalty_last_n == 8
    assert fields(repeat_last_n=-1).penalty_last_n == WHOLE_CONTEXT
    off = fields(repeat_last_n=0, repeat_penalty=1.5, presence_penalty=1.0)
    assert (off.repetition_penalty, off.presence_penalty, off.penalty_last_n) == (1.0, 0.0, None)
    assert "repetition_penalty" not in off.unset          # a model's recommended penalty stays off too
    with pytest.raises(Exception, match="repeat_last_n"):
        fields(repeat_last_n=-2)


def test_repeat_last_n_zero_replies_as_no_penalty(client, server):
    greedy = {"temperature": 0, "num_predict": 24}
    plain = client.chat(model=server.model, messages=HELLO, options=greedy)
    off = client.chat(model=server.model, messages=HELLO, options={**greedy, "repeat_penalty": 5.0, "repeat_last_n": 0})
    penalised = client.chat(model=server.model, messages=HELLO, options={**greedy, "repeat_penalty": 5.0})
    assert off.message.content == plain.message.content != penalised.message.content


def test_without_num_predict_the_reply_stops_at_the_server_default(make_server):
    live = make_server(chat_max_tokens=5)
    reply = ollama.Client(host=live.url, timeout=60).chat(model=live.model, messages=HELLO,
                                                          options={"temperature": 0})
    assert reply.eval_count == 5 and reply.done_reason == "length"


def test_format_constrains_the_reply(client, server):
    reply = client.chat(model=server.model, messages=HELLO, format=WEATHER, options={"temperature": 0,
                                                                                     "num_predict": 200})
    jsonschema.validate(json.loads(reply.message.content), WEATHER)
    # "json": an object, which a random model may not close within num_predict
    as_json = client.generate(model=server.model, prompt="JSON please", format="json",
                              options={"temperature": 0, "num_predict": 200})
    assert as_json.response.lstrip().startswith("{")
    if as_json.done_reason == "stop":
        assert isinstance(json.loads(as_json.response), dict)


def test_forced_tool_calls_come_whole_with_object_arguments(server):
    body = {"model": server.model, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS, "tool_choice": "required", "options": {"temperature": 0, "num_predict": 200}}
    whole = httpx.post(server.url + "/api/chat", json={**body, "stream": False}, timeout=60).json()
    calls = whole["message"]["tool_calls"]
    assert calls and whole["message"]["content"] == "" and whole["done_reason"] == "stop"
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in calls:
        jsonschema.validate(call["function"]["arguments"], schemas[call["function"]["name"]])
    streamed = lines(server, "/api/chat", body)
    streamed_calls = [c for line in streamed for c in line.get("message", {}).get("tool_calls", [])]
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]
    # the client's own types take them, and the conversation goes on with the result
    reply = ollama.ChatResponse.model_validate(whole)
    call = reply.message.tool_calls[0]
    conversation = [*body["messages"], reply.message,
                    {"role": "tool", "tool_name": call.function.name, "content": "21 degrees"}]
    after = ollama.Client(host=server.url, timeout=60).chat(model=server.model, messages=conversation,
                                                            tools=TOOLS, options=GREEDY)
    assert after.done and after.prompt_eval_count > whole["prompt_eval_count"]


def stream_chars(fmt: OllamaFormat, text: str, reason: FinishReason) -> tuple[Choice, list[dict]]:
    """`text` through `fmt` a character at a time, ended by `reason`: the choice and its chunks."""
    choice, chunks = Choice(0, 0), []
    for i, char in enumerate(text):
        last = i == len(text) - 1
        output = RequestOutput("r", [i], char, finished=last, finish_reason=reason if last else None)
        choice.add(output)
        chunks += fmt.deltas(choice, output)
    return choice, chunks + fmt.flush(choice)


def test_tool_calls_in_a_stream_come_whole_after_the_text():
    """A model's own (unforced) call: the parser's format, streamed a character at a time."""
    parser = get_parser("hermes")
    text = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' \
           "\n</tool_call>"
    fmt = OllamaFormat("chat", "m", Clock(0.0), tools=ToolReplies(parser))
    choice, chunks = stream_chars(fmt, text, FinishReason.STOP)
    content = "".join(c["message"]["content"] for c in chunks)
    assert content == "Let me look."
    assert chunks[-1]["message"]["tool_calls"][0]["function"] == {
        "index": 0, "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    final = fmt.final(choice)
    assert final["done"] and final["done_reason"] == "stop" and final["message"]["content"] == ""


def test_a_call_cut_by_num_predict_is_left_out():
    """Ollama's shape cannot mark a call as cut: one with its arguments as far as they
    went (repaired into `{}` or `{"city": "Par"}`) was sent as a call, and LangChain's
    agent ran the tool with them. Complete calls only, whole and streamed."""
    parser = get_parser("hermes")
    done = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for cut in ('{"name": "get_weather", "arguments": {', '{"name": "get_weather", "arguments": {"city": "Par'):
        text = f"Let me look.{done}<tool_call>\n{cut}"
        fmt = OllamaFormat("chat", "m", Clock(0.0), tools=ToolReplies(parser))
        whole = Choice(0, 0)
        whole.add(RequestOutput("r", [0], text, finished=True, finish_reason=FinishReason.LENGTH))
        body = fmt.body([whole])
        assert body["done_reason"] == "length" and body["message"]["content"] == "Let me look."
        assert [c["function"]["arguments"] for c in body["message"]["tool_calls"]] == [{"city": "Paris"}]
        _, chunks = stream_chars(fmt, text, FinishReason.LENGTH)
        calls = [c for chunk in chunks for c in chunk["message"].get("tool_calls", [])]
        assert [c["function"]["arguments"] for c in calls] == [{"city": "Paris"}]
        assert "".join(c["message"]["content"] for c in chunks) == "Let me look."


def test_durations_come_from_the_engine_s_timestamps():
    choice = Choice(0, 0, num_prompt_tokens=5, num_output_tokens=3,
                    timings=RequestTimings(arrival=10.0, scheduled=10.5, first_token=11.0, finished=12.25))
    fmt = OllamaFormat("generate", "m", Clock(0.0, waited=0.125))
    final = fmt.final(choice)
    assert final["prompt_eval_duration"] == 500_000_000 and final["eval_duration"] == 1_250_000_000
    assert final["load_duration"] == 125_000_000 and final["prompt_eval_count"] == 5 and final["eval_count"] == 3
    # a figure the engine did not report is left out, not made up
    assert "eval_duration" not in fmt.final(Choice(0, 0))


def test_thinking_comes_apart_and_think_false_leaves_it_out(make_server, make_tiny_model):
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.engine.config import Quantization
    from tests.server.conftest import build_server

    model = load_model(make_tiny_model(reasoning="opens"), "cpu", Quantization.F32)
    live = build_server(model)
    try:
        client = ollama.Client(host=live.url, timeout=60)
        ask = {"model": live.model, "messages": HELLO, "options": {"temperature": 0, "num_predict": 30}}
        raw = httpx.post(live.url + "/v1/chat/completions", json={
            "model": live.model, "messages": HELLO, "temperature": 0, "max_tokens": 30}, timeout=60).json()
        reply = client.chat(**ask, think=True)
        assert reply.message.thinking == raw["choices"][0]["message"]["reasoning"]
        assert reply.message.content == (raw["choices"][0]["message"]["content"] or "")
        parts = list(client.chat(**ask, think=True, stream=True))
        assert "".join(p.message.thinking or "" for p in parts) == reply.message.thinking
        assert "".join(p.message.content for p in parts) == reply.message.content
        hidden = client.chat(**ask, think=False)
        assert hidden.message.thinking is None
        shown = client.show(live.model)
        assert "thinking" in shown.capabilities
    finally:
        live.stop()
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=make_server().url, timeout=60).chat(model="tiny", messages=HELLO, think=True)
    assert refused.value.status_code == 400 and "does not support thinking" in refused.value.error


def test_models_version_show_and_ps(client, server):
    listed = client.list()
    names = [m.model for m in listed.models]
    assert server.model + ":latest" in names   # Ollama's names carry a tag; LangChain checks for it
    mine = next(m for m in listed.models if m.model == server.model + ":latest")
    assert mine.details.family == "llama" and mine.details.format == "safetensors"
    assert mine.details.quantization_level == "none" and mine.details.parameter_size.endswith("M")
    running = client.ps()
    loaded = next(m for m in running.models if m.model == server.model + ":latest")
    assert loaded.size > 0 and loaded.size_vram == 0 and loaded.context_length == 1024
    shown = client.show(server.model)
    assert shown.capabilities[0] == "completion" and shown.template
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 1024
    # the Ollama API level answered (clients compare it with Ollama's releases), ruvllm's own beside it
    assert httpx.get(server.url + "/api/version").json() == {"version": "0.11.0", "ruvllm_version": __version__}
    # Ollama's clients add the default tag
    assert client.chat(model=server.model + ":latest", messages=HELLO, options=GREEDY).eval_count == 12


def test_load_and_unload_requests(pool_server, tiny_model_dir):
    """A pooled model: an empty request loads it, keep_alive 0 unloads it."""
    live, loads = pool_server(names=("a",), keep_alive=None)
    client = ollama.Client(host=live.url, timeout=60)
    assert [m.model for m in client.list().models] == ["a:latest"] and client.ps().models == []
    # its files' bytes and a digest of them, as Ollama's list gives (UIs show the size, and
    # the digest's start as the ID); the quantized-weight cache beside them is not counted
    listed = client.list().models[0]
    files = [f for f in tiny_model_dir.rglob("*") if f.is_file() and not f.relative_to(tiny_model_dir).parts[0]
             .startswith(".")]
    assert listed.size == sum(f.stat().st_size for f in files)
    assert len(listed.digest) == 64 and int(listed.digest, 16) >= 0 and client.list().models[0].digest == listed.digest
    loaded = client.chat(model="a", messages=[])
    assert loaded.done and loaded.done_reason == "load" and loads.calls == {"a": 1}
    running = client.ps().models
    assert [m.model for m in running] == ["a:latest"] and running[0].expires_at is None   # no keep-alive: never
    assert client.list().models[0].details.family == "llama"
    unloaded = client.generate(model="a", keep_alive=0)
    assert unloaded.done_reason == "unload"
    wait_for(lambda: not client.ps().models)
    # not loaded: what its files say, and /api/show loads nothing for it (as Ollama's)
    assert client.list().models[0].details.family == "llama"
    assert client.list().models[0].details.quantization_level == ""   # the load decides
    shown = client.show("a")
    assert shown.modelinfo["llama.context_length"] == 4096 and shown.template and loads.calls == {"a": 1}
    assert client.chat(model="a", messages=HELLO, options=GREEDY).eval_count == 12 and loads.calls == {"a": 2}


def test_values_ollama_takes_into_range_are_taken_as_it_does(client, server):
    """Ollama's sampler clamps what OpenAI's API refuses, and clients send its defaults
    (seed -1): each was a 400, and seed -1 fixed every reply to one text."""
    greedy = client.chat(model=server.model, messages=HELLO, options=GREEDY).message.content
    for options in ({"temperature": -1}, {"temperature": 1.0, "top_p": 0}, {"temperature": 1.0, "min_p": 1.5}):
        assert client.chat(model=server.model, messages=HELLO, options={**GREEDY, **options}).message.content == greedy
    hot = {"temperature": 5, "top_k": -1, "top_p": 1.5, "num_predict": 12}
    assert client.chat(model=server.model, messages=HELLO, options=hot).eval_count == 12
    unseeded = {"temperature": 1.0, "top_k": 0, "seed": -1, "num_predict": 12}
    replies = {client.chat(model=server.model, messages=HELLO, options=unseeded).message.content for _ in range(3)}
    assert len(replies) > 1
    seeded = {**unseeded, "seed": 5}
    assert len({client.chat(model=server.model, messages=HELLO, options=seeded).message.content
                for _ in range(2)}) == 1


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"model": "nope", "messages": HELLO}, 404, "does not exist"),
    ({"messages": HELLO}, 400, "'model'"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "images"),
    ({"model": "tiny", "messages": HELLO, "format": "yaml"}, 400, "format"),
    ({"model": "tiny", "messages": HELLO, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ({"model": "tiny", "messages": HELLO, "options": {"num_predict": 0}}, 400, "num_predict"),
    ({"model": "tiny", "messages": HELLO, "think": "max"}, 400, "think"),
    ({"model": "tiny", "messages": HELLO, "keep_alive": "soon"}, 400, "keep_alive"),
    ({"model": "tiny", "messages": HELLO, "keep_alive": "inf"}, 400, "keep_alive"),
    ({"model": "tiny", "messages": HELLO, "options": {"top_k": 2.5}}, 400, "options.top_k"),
    ({"model": "tiny", "messages": HELLO, "options": {"num_predict": -3}}, 400, "options.num_predict"),
    ({"model": "tiny", "messages": [], "keep_alive": 0}, 400, "stays loaded"),
])
def test_bad_chat_requests_are_ollama_errors(server, body, status, words):
    response = httpx.post(server.url + "/api/chat", json=body, timeout=60)
    assert response.status_code == status
    assert set(response.json()) == {"error"} and words in response.json()["error"]


def test_bad_generate_requests_and_unknown_routes(server, client):
    for field, value in (("suffix", "x"), ("template", "{{ .Prompt }}"), ("context", [1, 2])):
        response = httpx.post(server.url + "/api/generate", json={"model": server.model, "prompt": "hi",
                                                                  field: value}, timeout=60)
        assert response.status_code == 400 and field in response.json()["error"]
    with pytest.raises(ollama.ResponseError) as pulled:
        client.pull("qwen")
    assert pulled.value.status_code == 404 and "ruvllm download" in pulled.value.error
    with pytest.raises(ollama.ResponseError) as embedded:
        client.embed(model=server.model, input="hi")
    assert embedded.value.status_code == 404 and "embeddings are not served" in embedded.value.error


def test_a_streamed_error_is_an_error_line(server, monkeypatch):
    """A constraint the engine gives up on mid-reply ends the stream with {"error": ...}."""
    from ruvllm_cli.server.ollama_api.responses import ollama_error_body
    from ruvllm_cli.server.errors import ApiError

    assert ollama_error_body(ApiError(503, "gone")) == {"error": "gone"}
    fmt = OllamaFormat("chat", "m", Clock(0.0))
    assert fmt.error_chunks(ApiError(400, "bad")) == [{"error": "bad"}]


def test_langchain_chat_ollama_drives_it(server):
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model=server.model, base_url=server.url, temperature=0, num_predict=12)
    message = llm.invoke("Hello! How are you today?")
    assert message.content and message.usage_metadata["output_tokens"] == 12
    assert "".join(chunk.content for chunk in llm.stream("Hello! How are you today?")) == message.content


def test_keep_alive_durations():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive(-1) == -1
    assert parse_keep_alive("0") == 0 and parse_keep_alive("250ms") == 0.25


def test_line_separators_in_a_reply_keep_the_stream_s_lines_whole(client, server):
    """U+2028, U+2029 and U+0085 went out raw; httpx's iter_lines (and the ollama client
    on it) split the JSON line there: JSONDecodeError mid-stream."""
    text = "x\u2028y\u2029z\u0085w"
    schema = {"type": "object", "properties": {"a": {"const": text}}, "required": ["a"], "additionalProperties": False}
    parts = list(client.chat(model=server.model, messages=HELLO, format=schema, stream=True,
                             options={"temperature": 0, "num_predict": 200}))
    assert parts[-1].done_reason == "stop"
    assert json.loads("".join(p.message.content for p in parts)) == {"a": text}
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "model": server.model, "messages": HELLO, "stream": True, "max_tokens": 200, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}) as sse:
        raw = b"".join(sse.iter_bytes())
    assert "\u2028".encode() not in raw and b"\\u2028" in raw


def test_num_predict_beyond_the_context_is_a_bound_not_an_error(client, server):
    """Ollama clamps num_predict to the room the context leaves; a 400 there broke apps
    whose conversations grew (LangChain with num_predict=2000)."""
    reply = client.generate(model=server.model, prompt="Hi", raw=True,
                            options={"temperature": 0, "num_predict": 10**9})
    used = reply.prompt_eval_count + reply.eval_count
    assert used == 1024 if reply.done_reason == "length" else reply.done_reason == "stop" and used < 1024


def test_a_final_assistant_message_is_continued(client, server):
    """Ollama continues (prefills) it, as /v1's continue_final_message; not a new turn."""
    turns = [*HELLO, {"role": "assistant", "content": "The weather is"}]
    reply = client.chat(model=server.model, messages=turns, options=GREEDY)
    same = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "model": server.model, "messages": turns, "temperature": 0, "max_tokens": 12,
        "continue_final_message": True, "add_generation_prompt": False}).json()
    assert reply.prompt_eval_count == same["usage"]["prompt_tokens"]
    assert reply.message.content == same["choices"][0]["message"]["content"]


def test_tool_results_answer_their_calls_in_order():
    """A result names its tool; two calls of one tool are answered oldest first, each
    call with an id of its own (they were numbered by tool name: ids repeated)."""
    from ruvllm_cli.server.ollama_api.protocol import _ollama_messages

    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
    messages = _ollama_messages([
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "tool_name": "get_weather", "content": "1"},
        {"role": "tool", "tool_name": "get_weather", "content": "2"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_name": "get_weather", "content": "3"}])
    ids = [c["id"] for m in messages for c in m.get("tool_calls") or []]
    assert ids == ["call_0", "call_1", "call_2"]
    assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == ids


def test_images_are_refused_on_generate_too(server):
    response = httpx.post(server.url + "/api/generate", json={"model": server.model, "prompt": "Hi",
                                                              "images": ["aGVsbG8="]}, timeout=60)
    assert response.status_code == 400 and "images" in response.json()["error"]


def test_a_conversation_beyond_the_context_loses_its_oldest_messages(client, server, openai_client):
    """Ollama's truncation: the system prompt and the end of the conversation stay, the
    oldest turns go, and the chat goes on (on /v1 the same conversation is a 400)."""
    words = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    turns = [{"role": "system", "content": "Be brief."}]
    for i in range(24):
        turns += [{"role": "user", "content": f"{i} {words}"}, {"role": "assistant", "content": words}]
    turns.append({"role": "user", "content": "And now?"})
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model=server.model, messages=turns, max_tokens=4)
    reply = client.chat(model=server.model, messages=turns, options={"temperature": 0, "num_predict": 4})
    assert reply.done and 0 < reply.prompt_eval_count < 1024
    # what was kept: the system prompt and a tail that opens with a user turn, billed the same on /v1
    def count(messages):
        return httpx.post(server.url + "/tokenize", json={"model": server.model, "messages": messages},
                          timeout=60).json()["count"]

    kept = next(turns[:1] + turns[start:] for start in range(1, len(turns), 2)
                if count(turns[:1] + turns[start:]) == reply.prompt_eval_count)
    assert count(turns[:1] + turns[turns.index(kept[1]) - 2:]) >= 1024   # one turn more would not fit
    assert kept[0]["role"] == "system" and kept[1]["role"] == "user" and kept[-1]["content"] == "And now?"
    alone = [{"role": "user", "content": " ".join([words] * 20)}]   # one message beyond the context: a 400
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=server.model, messages=alone, options=GREEDY)
    assert refused.value.status_code == 400


def test_a_model_without_a_chat_template(tiny_model_dir, tmp_path):
    """/api/generate takes its prompt as written; /api/chat and a system prompt say why not."""
    import shutil

    from ruvllm_cli.engine.config import Quantization
    from ruvllm_cli.engine.loader import load_model
    from tests.server.conftest import build_server

    plain = shutil.copytree(tiny_model_dir, tmp_path / "plain")
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    live = build_server(load_model(plain, "cpu", Quantization.F32))
    try:
        client = ollama.Client(host=live.url, timeout=60)
        written = client.generate(model=live.model, prompt="Hi there", options=GREEDY)
        raw = client.generate(model=live.model, prompt="Hi there", raw=True, options=GREEDY)
        assert written.response == raw.response and written.eval_count == 12
        for ask in (lambda: client.chat(model=live.model, messages=HELLO),
                    lambda: client.generate(model=live.model, prompt="Hi", system="Be brief.")):
            with pytest.raises(ollama.ResponseError) as refused:
                ask()
            assert refused.value.status_code == 400 and "chat template" in refused.value.error
    finally:
        live.stop()
