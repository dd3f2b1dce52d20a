"""Anthropic's Messages API (POST /v1/messages) through the official anthropic SDK over
the real socket: the same engine path as chat completions (the same prompt tokens,
the same greedy text, the prefix cache, forced tool calls, LoRA adapters), Anthropic's
body, stream events, stop reasons and error shape, and x-api-key."""

from __future__ import annotations

import json
import uuid
from typing import Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest

from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.engine.tool_parsers import ToolCall, get_parser
from ruvllm_cli.server.bridge import Choice
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.messages_api.protocol import parse_messages_request
from ruvllm_cli.server.messages_api.responses import MessagesFormat, stop_reason
from ruvllm_cli.server.sse import encode_event
from ruvllm_cli.server.tool_output import ToolReplies
from tests.server.test_tools import ADD, WEATHER

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]
# This SDK has no sampling arguments (Anthropic dropped them): older clients send them in the body.
GREEDY = {"extra_body": {"temperature": 0, "ignore_eos": True}}
TOOLS = [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER},
         {"name": "add", "description": "the add tool", "input_schema": ADD}]
EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
          "message_stop")


@pytest.fixture
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def chat_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def create(client, server, **kwargs):
    kwargs.setdefault("messages", HELLO)
    kwargs.setdefault("max_tokens", 12)
    return client.messages.create(model=server.model, **kwargs)


def raw_events(server, body, headers=None) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed /v1/messages answer, read off the wire."""
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", json={"model": server.model, "stream": True, **body},
                      headers=headers, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = response.read().decode()
    assert text.endswith("\n\n") and "[DONE]" not in text
    for raw in text.strip("\n").split("\n\n"):
        name, data = raw.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    assert all(data["type"] == name for name, data in events)
    return events


def check_event_order(events) -> None:
    """Anthropic's grammar: message_start, blocks (start, deltas, stop), message_delta, message_stop."""
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    open_index, started = None, 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == started
            open_index, started = started, started + 1
        elif name == "content_block_delta":
            assert data["index"] == open_index
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None


def test_a_reply_with_anthropics_body_and_usage(client, server):
    reply = create(client, server, **GREEDY)
    assert reply.type == "message" and reply.id.startswith("msg_") and reply.role == "assistant"
    assert reply.model == "tiny"
    [block] = reply.content
    assert block.type == "text" and block.text
    assert (reply.stop_reason, reply.stop_sequence) == ("max_tokens", None)
    prompt = server.engine(lambda e: e.tokenizer.encode(e.tokenizer.apply_chat_template(
        HELLO, add_generation_prompt=True, tokenize=False), add_special_tokens=False))
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)
    assert reply.usage.output_tokens == 12 and reply.usage.cache_creation_input_tokens == 0


def test_the_stream_is_anthropics_events_and_equals_the_plain_reply(client, server):
    plain = create(client, server, max_tokens=16, **GREEDY)
    events = raw_events(server, {"messages": HELLO, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    check_event_order(events)
    names = [name for name, _ in events]
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * (len(names) - 5),
                     "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    assert all(data["delta"]["type"] == "text_delta" for name, data in events if name == "content_block_delta")
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == plain.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 16
    with client.messages.stream(model=server.model, messages=HELLO, max_tokens=16, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == plain.content[0].text
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in plain.content]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 16
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens


def test_the_system_prompt_goes_through_the_chat_template(client, chat_client, server):
    system = "You are a terse assistant."
    reply = create(client, server, system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
                   max_tokens=8, **GREEDY)
    chat = chat_client.chat.completions.create(model=server.model, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True},
                                               messages=[{"role": "system", "content": system}, *HELLO])
    plain = create(client, server, max_tokens=8, **GREEDY)
    total = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert total == chat.usage.prompt_tokens > plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    assert reply.content[0].text == chat.choices[0].message.content


def test_a_stop_sequence_ends_the_reply_and_is_echoed(client, server):
    text = create(client, server, max_tokens=24, **GREEDY).content[0].text
    start = next(i for i in range(2, len(text) - 1) if text[i:i + 2].isalnum())
    stop = text[start:start + 2]
    cut = create(client, server, max_tokens=24, stop_sequences=["never-seen", stop], **GREEDY)
    assert cut.content[0].text == text[:text.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    events = raw_events(server, {"messages": HELLO, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                                 "stop_sequences": [stop]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == text[:text.index(stop)]


@pytest.mark.parametrize("finish, calls, stop, expected", [
    (FinishReason.STOP, [], None, ("end_turn", None)),           # EOS, or a grammar that is complete
    (FinishReason.STOP, [], "##", ("stop_sequence", "##")),
    (FinishReason.STOP, [ToolCall("call_1", "add", "{}")], None, ("tool_use", None)),
    (FinishReason.LENGTH, [ToolCall("call_1", "add", "{")], None, ("max_tokens", None)),
    (None, [], None, (None, None)),
])
def test_stop_reasons(finish, calls, stop, expected):
    assert stop_reason(Choice(0, 0, finish_reason=finish, tool_calls=calls, stop_string=stop)) == expected


def tool_uses(message):
    return [block for block in message.content if block.type == "tool_use"]


def test_a_forced_tool_gives_a_valid_tool_use_block(client, server):
    for seed in range(6):
        reply = create(client, server, tools=TOOLS, tool_choice={"type": "tool", "name": "add"}, max_tokens=300,
                       extra_body={"temperature": 1, "seed": seed})
        assert reply.stop_reason == "tool_use", reply
        calls = tool_uses(reply)
        assert calls and [b.type for b in reply.content] == ["tool_use"] * len(calls)   # up to 5 in parallel
        assert len({call.id for call in calls}) == len(calls)
        for call in calls:
            assert call.name == "add" and call.id.startswith("toolu_")
            jsonschema.validate(call.input, ADD)


def test_a_forced_tool_streams_input_json_deltas(client, server):
    for seed in range(4):
        body = {"messages": HELLO, "max_tokens": 300, "temperature": 1, "seed": seed, "tools": TOOLS,
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
        events = raw_events(server, body)
        check_event_order(events)
        [start] = [data["content_block"] for name, data in events if name == "content_block_start"]
        assert start["type"] == "tool_use" and start["input"] == {} and start["id"].startswith("toolu_")
        pieces = [data["delta"] for name, data in events if name == "content_block_delta"]
        assert pieces and all(p["type"] == "input_json_delta" for p in pieces)
        streamed = json.loads("".join(p["partial_json"] for p in pieces))
        jsonschema.validate(streamed, {"get_weather": WEATHER, "add": ADD}[start["name"]])
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
        whole = create(client, server, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                       max_tokens=300, extra_body={"temperature": 1, "seed": seed})
        [call] = tool_uses(whole)
        assert (call.name, call.input) == (start["name"], streamed)
    with client.messages.stream(model=server.model, messages=HELLO, max_tokens=300, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"seed": 1}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and tool_uses(final)
    for call in tool_uses(final):
        assert call.name == "get_weather"
        jsonschema.validate(call.input, WEATHER)


def test_a_forced_tool_that_max_tokens_cuts_is_a_tool_use_block_streamed_or_not(client, server):
    """stop_reason "max_tokens" and a tool_use block whose input is an object (what the
    arguments so far repair to), never a 500; the stream as Anthropic's SDK reads it."""
    cut = 0
    for seed in range(4):
        ask = dict(model=server.model, messages=HELLO, max_tokens=12, tools=TOOLS,
                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 1, "seed": seed})
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            final = stream.get_final_message()
        for message in (whole, final):
            assert message.stop_reason in ("max_tokens", "tool_use")
            assert all(isinstance(call.input, dict) and call.name == "get_weather" for call in tool_uses(message))
        assert [c.name for c in tool_uses(whole)] == [c.name for c in tool_uses(final)]
        cut += whole.stop_reason == "max_tokens" and bool(tool_uses(whole))
    assert cut >= 2


def test_output_config_format_constrains_the_reply_to_its_schema(client, server):
    """Anthropic's structured output, through the SDK's own `messages.parse` too."""
    import pydantic

    class Weather(pydantic.BaseModel):   # short values: the SDK moves length limits into descriptions
        city: Literal["paris", "rome"]
        sunny: bool

    for seed in range(3):
        parsed = client.messages.parse(model=server.model, messages=HELLO, max_tokens=200, output_format=Weather,
                                       extra_body={"temperature": 1, "seed": seed})
        assert parsed.stop_reason == "end_turn" and isinstance(parsed.parsed_output, Weather), parsed
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    ask = dict(model=server.model, messages=HELLO, max_tokens=100,
               output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body={"seed": 1})
    whole = client.messages.create(**ask)
    jsonschema.validate(json.loads(whole.content[0].text), schema)
    with client.messages.stream(**ask) as stream:
        assert stream.get_final_message().content[0].text == whole.content[0].text
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**{**ask, "output_config": {"format": {"type": "xml"}}})
    anthropic_error(caught, 400, "invalid_request_error", "'output_config.format.type'")


def test_tool_use_and_tool_result_blocks_render_through_the_template(client, chat_client, server):
    call = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": "What is 2 + 3?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me add."}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                                     {"type": "text", "text": "Thanks; and the weather?"}]},
    ]
    reply = create(client, server, messages=conversation, tools=TOOLS, max_tokens=6, **GREEDY)
    chat = chat_client.chat.completions.create(model=server.model, max_tokens=6, temperature=0,
                                               extra_body={"ignore_eos": True}, tools=[
        {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                          "parameters": t["input_schema"]}} for t in TOOLS], messages=[
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        {"role": "user", "content": "Thanks; and the weather?"}])
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert "".join(b.text for b in reply.content if b.type == "text") == (chat.choices[0].message.content or "")
    job = parse_messages_request({"model": "tiny", "max_tokens": 6, "messages": conversation, "tools": TOOLS})
    assert job.tools is not None
    prompt = server.engine(lambda e: e.tokenizer.apply_chat_template(
        job.messages, tools=[t.for_template() for t in job.tools.tools], tokenize=False,
        add_generation_prompt=True))
    assert 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in prompt
    assert "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>user\nThanks; and the weather?" in prompt


def test_a_long_system_prompt_is_read_from_the_prefix_cache_the_second_time(client, server):
    system = f"{uuid.uuid4().hex} " + "Computers store numbers in binary. A byte has eight bits. " * 20
    first = create(client, server, system=system, max_tokens=2)
    second = create(client, server, system=system, max_tokens=2)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens > 200
    cached = second.usage.cache_read_input_tokens
    assert cached > 0 and cached % 16 == 0
    assert second.usage.input_tokens + cached == first.usage.input_tokens


def anthropic_error(caught, status: int, kind: str, contains: str) -> None:
    error = caught.value
    assert error.status_code == status
    assert error.body == {"type": "error", "error": {"type": kind, "message": error.body["error"]["message"]}}
    assert contains in error.body["error"]["message"], error.body


def test_errors_are_in_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=server.model, messages=HELLO, max_tokens=None)  # type: ignore[arg-type]
    anthropic_error(caught, 400, "invalid_request_error", "Missing required parameter: 'max_tokens'")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(client, server, messages=[{"role": "user", "content": [image]}])
    anthropic_error(caught, 400, "invalid_request_error", "'messages[0].content[0].type'")
    assert "not supported" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="nope", messages=HELLO, max_tokens=4)
    anthropic_error(caught, 404, "not_found_error", "The model 'nope' does not exist")
    body = httpx.post(server.url + "/v1/messages", content=b"{", timeout=10)
    assert body.status_code == 400 and body.json()["type"] == "error"
    # A path under /v1/messages that is not served: still Anthropic's shape.
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.batches.retrieve("msgbatch_1")
    anthropic_error(caught, 404, "not_found_error", "Unknown route: GET /v1/messages/batches/msgbatch_1")
    assert httpx.post(server.url + "/v1/messagesx", json={}, timeout=10).json()["error"]["type"] != "not_found_error"
    other = httpx.post(server.base_url + "/chat/completions", json={"model": "nope", "messages": HELLO}, timeout=10)
    assert set(other.json()) == {"error"}   # the OpenAI routes keep OpenAI's shape


@pytest.mark.parametrize("fields, param", [
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
    ({"stop_sequences": [1]}, "stop_sequences[0]"),
    ({"system": [{"type": "image"}]}, "system[0].type"),
    ({"system": 3}, "system"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "Sure"}]}, "messages[1].role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "add", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "add", "input": "x"}]},
                   *HELLO]}, "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [{"type": "image"}]}]}]},
     "messages[0].content[0].content[0].type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "add"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name!", "input_schema": {}}]}, "tools[0].name"),
    ({"tools": [{"name": "n", "input_schema": {"type": "integer"}}]}, "tools[0].input_schema.type"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "bogus"}}}}, "output_config.format"),
    ({"tools": TOOLS, "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "tool_choice"),
    ({"tools": [{"name": "n", "input_schema": {"type": ["string", "null"]}}]}, "tools[0].input_schema.type"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"metadata": {"user_id": 3}}, "metadata.user_id"),
])
def test_a_bad_field_is_a_400_naming_it(server, fields, param):
    body = {"model": server.model, "messages": HELLO, "max_tokens": 4, **fields}
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert f"'{param}'" in error["error"]["message"], error


def test_unknown_fields_and_anthropic_headers_are_accepted(server):
    body = {"model": server.model, "messages": HELLO, "max_tokens": 2, "thinking": {"type": "disabled"},
            "service_tier": "auto", "metadata": {"user_id": "someone"}}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "whatever"}
    response = httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["output_tokens"] <= 2


def test_x_api_key_or_bearer_and_a_missing_key_is_anthropics_401(make_server):
    live = make_server(api_key="s3cret")
    keyed = anthropic.Anthropic(base_url=live.url, api_key="s3cret", max_retries=0, timeout=60)
    assert keyed.messages.create(model=live.model, messages=HELLO, max_tokens=2).type == "message"
    bearer = anthropic.Anthropic(base_url=live.url, api_key=None, auth_token="s3cret", max_retries=0, timeout=60)
    assert bearer.messages.create(model=live.model, messages=HELLO, max_tokens=2).type == "message"
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(
            model=live.model, messages=HELLO, max_tokens=2)
    anthropic_error(caught, 401, "authentication_error", "Incorrect API key")
    missing = httpx.post(live.url + "/v1/messages", json={"model": live.model, "messages": HELLO, "max_tokens": 2})
    assert missing.status_code == 401
    assert missing.json() == {"type": "error", "error": {"type": "authentication_error", "message": (
        "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.")}}
    # The OpenAI routes take x-api-key too, and keep their own error shape.
    assert httpx.get(live.base_url + "/models", headers={"x-api-key": "s3cret"}).status_code == 200
    assert set(httpx.get(live.base_url + "/models").json()) == {"error"}


@pytest.fixture
def lora_live(tiny_model_dir, tmp_path):
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.quantization import Quantization
    from ruvllm_cli.testing.tiny_lora import MLP, build_lora_adapter
    from tests.server.conftest import start_adapter_server

    adapter = build_lora_adapter(tiny_model_dir, tmp_path / "mlp", rank=8, targets=MLP, seed=2)
    live = start_adapter_server(load_model(tiny_model_dir, "cpu", Quantization.F32), {"mlp": adapter})
    yield live
    live.assert_clean()
    live.stop()


def test_a_lora_adapter_is_a_model(lora_live):
    client = anthropic.Anthropic(base_url=lora_live.url, api_key="unused", max_retries=0, timeout=60)
    chat = openai.OpenAI(base_url=lora_live.base_url, api_key="unused", max_retries=0, timeout=60)
    texts = {}
    for model in ("tiny", "mlp"):
        reply = client.messages.create(model=model, messages=HELLO, max_tokens=8, **GREEDY)
        expected = chat.chat.completions.create(model=model, messages=HELLO, max_tokens=8, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert reply.model == model and reply.content[0].text == expected.choices[0].message.content
        texts[model] = reply.content[0].text
    assert texts["tiny"] != texts["mlp"]


# ---- the stream's blocks, without a server ---------------------------------------------
REPLY = ('Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')


def streamed_blocks(pieces: list[str]) -> tuple[list[tuple[str, dict]], list[dict]]:
    """The events of a hermes reply fed in `pieces`, and the content blocks they build."""
    fmt, choice = MessagesFormat("tiny", ToolReplies(get_parser("hermes"))), Choice(0, 0)
    events = []
    for piece in pieces:
        output = RequestOutput("r", [1], piece)
        choice.add(output)
        events += fmt.deltas(choice, output)
    choice.finish_reason = FinishReason.STOP
    events += [*fmt.flush(choice), fmt.final(choice), *fmt.closing([choice])]
    pairs = [(e.name, e.data) for e in events]
    blocks, buffers = [], {}
    for name, data in pairs:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta" and data["delta"]["type"] == "text_delta":
            blocks[data["index"]]["text"] += data["delta"]["text"]
        elif name == "content_block_delta":
            buffers[data["index"]] = buffers.get(data["index"], "") + data["delta"]["partial_json"]
    for index, text in buffers.items():
        blocks[index]["input"] = json.loads(text)
    return pairs, blocks


def without_ids(blocks: list[dict]) -> list[dict]:
    return [{k: v for k, v in block.items() if k != "id"} for block in blocks]


def test_a_reply_split_anywhere_streams_the_blocks_of_its_body():
    choice = Choice(0, 0, text=REPLY, finish_reason=FinishReason.STOP)
    body = MessagesFormat("tiny", ToolReplies(get_parser("hermes"))).body([choice])
    assert [b["type"] for b in body["content"]] == ["text", "tool_use", "tool_use"]
    assert body["stop_reason"] == "tool_use" and body["content"][1]["input"] == {"a": 1, "b": 2}
    splits = [[REPLY[:i], REPLY[i:]] for i in range(1, len(REPLY))] + [list(REPLY)]
    for pieces in splits:
        events, blocks = streamed_blocks(pieces)
        check_event_order(events)
        assert without_ids(blocks) == without_ids(body["content"]), pieces
        assert all(b["id"].startswith("toolu_") for b in blocks[1:])
        assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_events_are_named_on_the_wire():
    fmt = MessagesFormat("tiny")
    assert encode_event(fmt.closing([])[0]) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    [error] = fmt.error_chunks(ApiError(503, "The server is shutting down."))
    assert encode_event(error) == (b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
                                   b'"message":"The server is shutting down."}}\n\n')
