"""OpenAI's Responses API (POST /v1/responses) through the official openai SDK over the
real socket: the same engine path as chat completions (the same prompt tokens, the same
greedy text, the prefix cache, forced function calls, structured output), the Response
object, its stream events (raw, through create(stream=True) and through the SDK's
stream helper), and the 400s of a stateless server in OpenAI's error shape."""

from __future__ import annotations

import json
import re
import uuid
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.engine.tool_parsers import get_parser
from ruvllm_cli.server.bridge import Choice
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.responses_api.events import ResponsesFormat
from ruvllm_cli.server.responses_api.output import ResponseHead
from ruvllm_cli.server.responses_api.protocol import parse_responses_request
from ruvllm_cli.server.sse import encode_event
from ruvllm_cli.server.tool_output import ToolReplies
from tests.server.test_tools import ADD, WEATHER

pytestmark = pytest.mark.timeout(120)

HELLO = "Hello! How are you today?"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather", "parameters": WEATHER},
         {"type": "function", "name": "add", "description": "the add tool", "parameters": ADD, "strict": True}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
# Each item's events between its output_item.added and output_item.done.
ITEM_EVENTS = {
    "message": re.compile(r" content_part\.added( output_text\.delta)* output_text\.done content_part\.done"),
    "function_call": re.compile(r"( function_call_arguments\.delta)* function_call_arguments\.done")}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def create(client, server, **kwargs):
    kwargs.setdefault("input", HELLO)
    kwargs.setdefault("max_output_tokens", 12)
    return client.responses.create(model=server.model, **kwargs)


def raw_events(server, body) -> list[dict]:
    """The data of a streamed /v1/responses answer, read off the wire (each event named by its type)."""
    with httpx.stream("POST", server.base_url + "/responses", json={"model": server.model, "stream": True, **body},
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = response.read().decode()
    assert text.endswith("\n\n") and "[DONE]" not in text
    events = []
    for raw in text.strip("\n").split("\n\n"):
        name, data = raw.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {events[-1]['type']}"
    return events


def check_event_order(events: list[dict]) -> None:
    """The Responses grammar: created, in_progress, items (added, their content, done), completed."""
    names = [e["type"] for e in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert len({e["response"]["id"] for e in (events[0], events[1], events[-1])}) == 1
    items, inner = [], []
    for event in events[2:-1]:
        kind = event["type"].removeprefix("response.")
        if kind == "output_item.added":
            assert event["output_index"] == len(items) and not inner
            items.append(event["item"])
        elif kind == "output_item.done":
            item = items[-1]
            assert event["output_index"] == len(items) - 1 and event["item"]["id"] == item["id"]
            assert ITEM_EVENTS[item["type"]].fullmatch("".join(" " + kind for kind in inner)), inner
            inner = []
        else:
            assert event["output_index"] == len(items) - 1 and event["item_id"] == items[-1]["id"]
            inner.append(kind)
    assert not inner
    assert [i["id"] for i in events[-1]["response"]["output"]] == [i["id"] for i in items]


def chat_prompt_tokens(server, messages, **kwargs) -> tuple[int, str]:
    chat = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    reply = chat.chat.completions.create(model=server.model, messages=messages, temperature=0,
                                         extra_body={"ignore_eos": True}, **kwargs)
    return reply.usage.prompt_tokens, reply.choices[0].message.content or ""


def test_a_response_with_openais_body_and_usage(client, server):
    reply = create(client, server, instructions="Be terse.", metadata={"topic": "greeting"}, store=True, **GREEDY)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == "tiny"
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text == reply.output_text != ""
    assert (reply.metadata, reply.instructions, reply.max_output_tokens) == ({"topic": "greeting"}, "Be terse.", 12)
    assert (reply.temperature, reply.top_p, reply.store, reply.previous_response_id) == (0, 1, False, None)
    assert reply.text.format.type == "text" and reply.tools == [] and reply.tool_choice == "auto"
    prompt, text = chat_prompt_tokens(server, [{"role": "system", "content": "Be terse."},
                                              {"role": "user", "content": HELLO}], max_tokens=12)
    usage = reply.usage
    assert usage.input_tokens == prompt and usage.output_tokens == 12 and usage.total_tokens == prompt + 12
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert 0 <= usage.input_tokens_details.cached_tokens < prompt
    assert reply.output_text == text


def test_the_stream_reassembles_to_the_plain_response(client, server):
    plain = create(client, server, max_output_tokens=16, **GREEDY)
    events = raw_events(server, {"input": HELLO, "max_output_tokens": 16, "temperature": 0, "ignore_eos": True})
    check_event_order(events)
    assert [e["type"] for e in events[2:5]] == ["response.output_item.added", "response.content_part.added",
                                                "response.output_text.delta"]
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == plain.output_text
    assert next(e["text"] for e in events if e["type"] == "response.output_text.done") == text
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and final["status"] == "incomplete"
    assert final["output"][0]["content"][0]["text"] == text
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert final["usage"][key] == getattr(plain.usage, key)
    sdk_events = list(create(client, server, max_output_tokens=16, stream=True, **GREEDY))
    assert [e.type for e in sdk_events] == [e["type"] for e in events]
    assert "".join(e.delta for e in sdk_events if e.type == "response.output_text.delta") == text
    # The SDK's helper: its final response exists for response.completed only (see the json_schema test).
    with client.responses.stream(model=server.model, input=HELLO, max_output_tokens=16, **GREEDY) as stream:
        helped = list(stream)
    assert "".join(e.delta for e in helped if e.type == "response.output_text.delta") == text
    assert helped[-1].type == "response.incomplete" and helped[-1].response.output_text == text
    assert helped[-1].response.usage.output_tokens == plain.usage.output_tokens == 16


def test_a_forced_function_call_is_a_valid_function_call_item(client, server):
    for seed in range(4):
        reply = create(client, server, tools=TOOLS, tool_choice="required", max_output_tokens=300, temperature=1,
                       extra_body={"seed": seed})
        assert reply.status == "completed", reply
        assert reply.output and all(item.type == "function_call" for item in reply.output)
        assert len({item.call_id for item in reply.output}) == len(reply.output)
        for item in reply.output:
            assert item.call_id.startswith("call_") and item.id == "fc_" + item.call_id.removeprefix("call_")
            assert item.status == "completed"
            jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])
    single = create(client, server, tools=TOOLS, tool_choice={"type": "function", "name": "add"},
                    parallel_tool_calls=False, max_output_tokens=300, extra_body={"seed": 1})
    [call] = single.output
    assert call.name == "add" and single.tool_choice.name == "add" and single.parallel_tool_calls is False
    assert [t.name for t in single.tools] == ["get_weather", "add"] and single.tools[1].strict is True
    assert single.tools[0].strict is True   # left out: strict, as applied (it echoed null)


def test_a_forced_call_streams_its_arguments(client, server):
    body = {"input": HELLO, "max_output_tokens": 300, "temperature": 1, "seed": 3, "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False}
    events = raw_events(server, body)
    check_event_order(events)
    [added] = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert added["type"] == "function_call" and added["arguments"] == "" and added["status"] == "in_progress"
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert next(e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done") == arguments
    jsonschema.validate(json.loads(arguments), SCHEMAS[added["name"]])
    [final] = events[-1]["response"]["output"]
    assert events[-1]["type"] == "response.completed"
    assert final == {**added, "arguments": arguments, "status": "completed"}
    whole = create(client, server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=300, temperature=1, extra_body={"seed": 3})
    assert [(c.name, json.loads(c.arguments)) for c in whole.output] == [(added["name"], json.loads(arguments))]
    with client.responses.stream(model=server.model, input=HELLO, tools=TOOLS, max_output_tokens=300,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 extra_body={"seed": 1}) as stream:
        response = stream.get_final_response()
    assert response.output and {item.name for item in response.output} == {"get_weather"}
    for item in response.output:
        jsonschema.validate(json.loads(item.arguments), WEATHER)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(min_length=1, max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]


def test_text_format_json_schema_constrains_the_reply(client, server):
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    for seed in range(2):
        reply = create(client, server, input="Describe a person.", text=text, max_output_tokens=200,
                       temperature=1, extra_body={"seed": seed})
        assert reply.status == "completed"
        jsonschema.validate(json.loads(reply.output_text), PERSON)
        assert reply.text.format.name == "person" and reply.text.format.schema_ == PERSON
    parsed = client.responses.parse(model=server.model, input="Describe a person.", text_format=Person,
                                    max_output_tokens=200, extra_body={"seed": 3})
    assert isinstance(parsed.output_parsed, Person)
    with client.responses.stream(model=server.model, input="Describe a person.", text_format=Person,
                                 max_output_tokens=200, extra_body={"seed": 3}) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_parsed == parsed.output_parsed and streamed.usage.output_tokens == parsed.usage.output_tokens
    as_json = create(client, server, text={"format": {"type": "json_object"}}, max_output_tokens=60,
                     extra_body={"seed": 1})
    assert as_json.output_text.startswith("{")


def test_function_call_items_and_their_outputs_render_as_the_chat_route_does(client, server):
    first = create(client, server, tools=TOOLS, tool_choice={"type": "function", "name": "add"},
                   parallel_tool_calls=False, max_output_tokens=300, extra_body={"seed": 2})
    [call] = first.output
    follow_up = [{"role": "user", "content": "What is the sum?"}, *first.output,
                 {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    reply = create(client, server, input=follow_up, tools=TOOLS, max_output_tokens=6, **GREEDY)
    chat_tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
                  for t in TOOLS]
    prompt, text = chat_prompt_tokens(server, [
        {"role": "user", "content": "What is the sum?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "5"}], tools=chat_tools, max_tokens=6)
    assert reply.usage.input_tokens == prompt
    assert "".join(i.content[0].text for i in reply.output if i.type == "message") == text
    job = parse_responses_request({"model": "tiny", "tools": TOOLS, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"role": "developer", "content": "Answer briefly."}]})
    assert job.tools is not None
    rendered = server.engine(lambda e: e.tokenizer.apply_chat_template(
        job.messages, tools=[t.for_template() for t in job.tools.tools], tokenize=False, add_generation_prompt=True))
    assert 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in rendered
    assert "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>system\nAnswer briefly." in rendered


def test_an_assistant_s_refusal_part_passed_back_is_its_text():
    """OpenAI's output messages carry a refusal as a `refusal` part; a client passing a
    reply's items back sends it as it came (it was a 400), as the chat route takes it."""
    def messages_of(part):
        return parse_responses_request({"model": "tiny", "input": [
            {"role": "user", "content": "x"}, {"role": "assistant", "content": [part]},
            {"role": "user", "content": "y"}]}).messages

    assert messages_of({"type": "refusal", "refusal": "I can't help with that."}) \
        == messages_of({"type": "output_text", "text": "I can't help with that."})


def test_a_long_prompt_is_read_from_the_prefix_cache_the_second_time(client, server):
    instructions = f"{uuid.uuid4().hex} " + "Computers store numbers in binary. A byte has eight bits. " * 20
    first = create(client, server, instructions=instructions, max_output_tokens=2)
    second = create(client, server, instructions=instructions, max_output_tokens=2)
    assert first.usage.input_tokens_details.cached_tokens == 0 and first.usage.input_tokens > 200
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0
    assert second.usage.input_tokens == first.usage.input_tokens


def test_what_needs_a_stored_response_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, server, previous_response_id="resp_123")
    assert caught.value.body["param"] == "previous_response_id" and "stateless" in caught.value.body["message"]
    for fields, param in (({"background": True}, "background"), ({"conversation": "conv_1"}, "conversation"),
                          ({"prompt": {"id": "pmpt_1", "version": "2"}}, "prompt"),   # had been ignored
                          ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type")):
        response = httpx.post(server.base_url + "/responses", json={"model": server.model, "input": HELLO, **fields})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="nope", input=HELLO)
    assert caught.value.body["param"] == "model"


@pytest.mark.parametrize("fields, param", [
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": None}]}]},
     "input[0].content[0].refusal"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": {}}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input[0].call_id"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "add"}}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "n", "parameters": {"type": "integer"}}]}, "tools[0].parameters.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"metadata": {"a": 1}}, "metadata.a"),
    ({"include": ["message.output_text.logprobs"]}, "include[0]"),
])
def test_a_bad_field_is_a_400_naming_it(server, fields, param):
    body = {"model": server.model, "input": HELLO, "max_output_tokens": 4, **fields}
    response = httpx.post(server.base_url + "/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert f"'{param}'" in error["message"], error


def test_unknown_and_ignored_fields_are_accepted(server):
    body = {"model": server.model, "input": HELLO, "max_output_tokens": 2, "reasoning": {"effort": "low"},
            "service_tier": "auto", "truncation": "auto", "include": ["reasoning.encrypted_content"],
            "text": {"verbosity": "low"}, "store": True, "background": False, "prompt_cache_key": "k"}
    response = httpx.post(server.base_url + "/responses", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] <= 2 and response.json()["store"] is False


# ---- the stream's items, without a server -------------------------------------------------
REPLY = ('Sure.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>')


def streamed_events(pieces: list[str]) -> list[dict]:
    """The events of a hermes reply fed in `pieces`."""
    fmt, choice = ResponsesFormat(ResponseHead("tiny", {}), ToolReplies(get_parser("hermes"))), Choice(0, 0)
    events = [*fmt.opening(choice)]
    for piece in pieces:
        output = RequestOutput("r", [1], piece)
        choice.add(output)
        events += fmt.deltas(choice, output)
    choice.finish_reason = FinishReason.STOP
    events += [*fmt.flush(choice), fmt.final(choice), *fmt.closing([choice])]
    return [e.data for e in events]


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_a_reply_split_anywhere_streams_the_items_of_its_body():
    choice = Choice(0, 0, text=REPLY, finish_reason=FinishReason.STOP)
    body = ResponsesFormat(ResponseHead("tiny", {}), ToolReplies(get_parser("hermes"))).body([choice])
    assert [i["type"] for i in body["output"]] == ["message", "function_call", "function_call"]
    assert body["status"] == "completed" and json.loads(body["output"][1]["arguments"]) == {"a": 1, "b": 2}
    splits = [[REPLY[:i], REPLY[i:]] for i in range(1, len(REPLY))] + [list(REPLY)]
    for pieces in splits:
        events = streamed_events(pieces)
        check_event_order(events)
        output = events[-1]["response"]["output"]
        assert without_ids(output) == without_ids(body["output"]), pieces
        for item in output[1:]:
            assert item["id"] == "fc_" + item["call_id"].removeprefix("call_")


def test_an_error_ends_the_stream_with_an_error_event():
    fmt = ResponsesFormat(ResponseHead("tiny", {}))
    fmt.opening(Choice(0, 0))
    [error] = fmt.error_chunks(ApiError(503, "The server is shutting down.", code="shutting_down"))
    assert encode_event(error) == (b'event: error\ndata: {"type":"error","code":"shutting_down","message":'
                                   b'"The server is shutting down.","param":null,"sequence_number":2}\n\n')


def test_a_call_cut_by_the_token_limit_is_incomplete_streamed_or_not():
    """The last item takes the reply's status, the others are completed, in the body as
    in the stream (the body had said "completed" for a cut call the stream called
    incomplete)."""
    cut = REPLY[:REPLY.rindex('"Paris"')]
    choice = Choice(0, 0, text=cut, finish_reason=FinishReason.LENGTH)
    body = ResponsesFormat(ResponseHead("tiny", {}), ToolReplies(get_parser("hermes"))).body([choice])
    assert [(i["type"], i["status"]) for i in body["output"]] == [
        ("message", "completed"), ("function_call", "completed"), ("function_call", "incomplete")]
    fmt, streamed = ResponsesFormat(ResponseHead("tiny", {}), ToolReplies(get_parser("hermes"))), Choice(0, 0)
    events = [*fmt.opening(streamed)]
    output = RequestOutput("r", [1], cut)
    streamed.add(output)
    events += fmt.deltas(streamed, output)
    streamed.finish_reason = FinishReason.LENGTH
    events += [*fmt.flush(streamed), fmt.final(streamed), *fmt.closing([streamed])]
    assert without_ids(events[-1].data["response"]["output"]) == without_ids(body["output"])
