"""Function calling through the official openai SDK over the real socket, on the
tiny random model (its chat template is Qwen2.5's hermes format): forced calls are
always valid, streamed in OpenAI's shape, in loops of several turns (issue 20)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(180)

HELLO = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 10},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                      "b": {"type": "integer", "minimum": -99, "maximum": 99}}}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def check_calls(calls, allowed=SCHEMAS):
    assert calls
    ids = [c.id for c in calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
    for call in calls:
        assert call.type == "function" and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def collect_stream(stream):
    """(content, calls by index as dicts, finish reason) from chunks, checking OpenAI's fragment shape."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for fragment in choice.delta.tool_calls or []:
                if fragment.index not in calls:
                    assert fragment.id and fragment.type == "function" and fragment.function.name
                    assert fragment.function.arguments == ""
                    calls[fragment.index] = {"id": fragment.id, "name": fragment.function.name, "arguments": ""}
                else:
                    assert fragment.id is None and fragment.function.name is None
                    calls[fragment.index]["arguments"] += fragment.function.arguments
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice, seeds", [("required", 15), ({"type": "function", "function": {"name": "add"}}, 10)])
def test_forced_calls_are_valid_over_many_seeds(client, server, choice, seeds):
    allowed = SCHEMAS if choice == "required" else {"add": ADD}
    for seed in range(seeds):
        reply = client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS, tool_choice=choice,
                                               temperature=1.0, seed=seed, max_tokens=300)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls", message
        check_calls(message.tool_calls, allowed)
        assert not message.content


def test_forced_calls_stream_in_openai_fragments(client, server):
    for seed in range(25):
        stream = client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS, stream=True,
                                                tool_choice="required", temperature=1.0, seed=seed, max_tokens=300)
        content, calls, finish = collect_stream(stream)
        assert finish == "tool_calls" and content == ""
        assert sorted(calls) == list(range(len(calls)))
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        if seed >= 5:
            continue
        whole = client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS,
                                               tool_choice="required", temperature=1.0, seed=seed, max_tokens=300)
        assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == \
            [(c["name"], c["arguments"]) for c in calls.values()]


def test_a_call_cut_off_by_max_tokens_is_the_same_call_streamed_or_not(client, server):
    """finish_reason "length" and the call as far as it went, in `tool_calls` both ways;
    no call markup in the content."""
    cut = 0
    for seed in range(6):
        ask = dict(model=server.model, messages=HELLO, tools=TOOLS, tool_choice="required", temperature=1.0,
                   seed=seed, max_tokens=14)
        whole = client.chat.completions.create(**ask).choices[0]
        content, calls, finish = collect_stream(client.chat.completions.create(**ask, stream=True))
        assert whole.finish_reason == finish and (whole.message.content or "") == content
        assert [(c.id.startswith("call_"), c.function.name, c.function.arguments)
                for c in whole.message.tool_calls or []] == [(True, c["name"], c["arguments"]) for c in calls.values()]
        assert "<tool_call>" not in content
        cut += finish == "length" and bool(calls)
    assert cut >= 3   # most seeds are cut inside their call's arguments


def test_special_tokens_other_than_the_markers_stay_out_of_a_reply_with_tools(client, server):
    """With tools the markers must reach the parser, yet <|pad|>, <|im_start|> and the
    like are still skipped, as in a reply without tools."""
    ids = server.engine(lambda e: e.tokenizer.convert_tokens_to_ids(["<|pad|>", "<|im_start|>"]))
    bias = {str(i): 8 for i in ids}
    for stream in (False, True):
        for seed in range(3):
            ask = dict(model=server.model, messages=HELLO, tools=TOOLS, max_tokens=12, seed=seed,
                       logit_bias=bias, temperature=1.0)
            if stream:
                content, calls, _ = collect_stream(client.chat.completions.create(**ask, stream=True))
            else:
                message = client.chat.completions.create(**ask).choices[0].message
                content, calls = message.content or "", message.tool_calls or []
            assert "<|pad|>" not in content and "<|im_start|>" not in content, content


def test_parallel_calls_off_gives_exactly_one(client, server):
    for seed in range(8):
        reply = client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS, seed=seed,
                                               tool_choice="required", parallel_tool_calls=False, max_tokens=300)
        assert len(reply.choices[0].message.tool_calls) == 1


def test_a_grammar_that_asks_for_three_calls_gives_three(client, server):
    call = '<tool_call> "\\n" %json {"type": "object", "additionalProperties": false, "required": ["name", ' \
           '"arguments"], "properties": {"name": {"const": "add"}, "arguments": ' + json.dumps(ADD) + \
           ', "x-guidance": {"whitespace_flexible": false}}} "\\n" </tool_call>'
    grammar = f'start: call "\\n" call "\\n" call\ncall: {call}'
    reply = client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS, max_tokens=300, seed=1,
                                           extra_body={"structured_outputs": {"grammar": grammar}})
    calls = reply.choices[0].message.tool_calls
    assert len(calls) == 3 and [c.function.name for c in calls] == ["add"] * 3
    check_calls(calls)
    # parallel_tool_calls false under tool_choice auto: the first call only, streamed or not
    # (OpenAI's promise; the three calls had all come back)
    ask = dict(model=server.model, messages=HELLO, tools=TOOLS, max_tokens=300, seed=1, parallel_tool_calls=False,
               extra_body={"structured_outputs": {"grammar": grammar}})
    one = client.chat.completions.create(**ask).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in one] == [(calls[0].function.name,
                                                                       calls[0].function.arguments)]
    content, streamed, finish = collect_stream(client.chat.completions.create(**ask, stream=True))
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in streamed.values()] == \
        [(c.function.name, c.function.arguments) for c in one]


def test_auto_with_no_call_is_plain_content(client, server):
    reply = client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content and not choice.message.tool_calls


def test_none_leaves_the_tools_out_of_the_prompt(client, server):
    with_tools = client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS, max_tokens=1)
    without = client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS, tool_choice="none",
                                             max_tokens=1)
    plain = client.chat.completions.create(model=server.model, messages=HELLO, max_tokens=1)
    assert without.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens


def test_five_turn_tool_loop_completes(make_server):
    server = make_server(engine={"max_model_len": 4096})
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    messages = list(HELLO)
    for turn in range(5):
        reply = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, seed=turn,
                                               tool_choice="required", parallel_tool_calls=False, max_tokens=200)
        [call] = reply.choices[0].message.tool_calls
        messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": turn})})
    final = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=5)
    assert final.choices[0].message.content is not None and not final.choices[0].message.tool_calls
    assert final.usage.prompt_tokens > 100


@pytest.fixture
def long_context_server(make_tiny_model):
    """The tiny model with a 32k context (100 tools make a prompt of some 15k tokens)."""
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.quantization import Quantization
    from tests.server.conftest import build_server

    model = load_model(make_tiny_model(max_position_embeddings=32768), "cpu", Quantization.F32)
    live = build_server(model, engine={"max_model_len": 32768, "max_num_seqs": 2})
    yield live
    live.stop()


def test_a_hundred_tools_in_one_request(long_context_server):
    server = long_context_server
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": ADD}} for i in range(100)]
    reply = client.chat.completions.create(model=server.model, messages=HELLO, tools=tools, tool_choice="required",
                                           max_tokens=300, seed=0, parallel_tool_calls=False)
    [call] = reply.choices[0].message.tool_calls
    print(f"100 tools: {reply.usage.prompt_tokens} prompt tokens")
    assert call.function.name.startswith("tool_") and reply.usage.prompt_tokens > 5000
    jsonschema.validate(json.loads(call.function.arguments), ADD)


def test_a_tool_schema_the_grammar_cannot_take_is_named_in_the_400(server):
    import httpx

    tools = [*TOOLS, {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}]
    response = httpx.post(f"{server.base_url}/chat/completions", timeout=30, json={
        "model": server.model, "messages": HELLO, "max_tokens": 5, "tools": tools, "tool_choice": "required"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "Lark" not in error["message"], error
    assert error["message"].startswith("the parameters schema of tool 'odd' cannot be enforced: "), error


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "n", "parameters": {"type": "integer"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": "x"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "content": "3"}]}, "messages[2].tool_call_id"),   # OpenAI's required field
])
def test_bad_tool_requests_are_400s(server, body, param):
    import httpx

    response = httpx.post(f"{server.base_url}/chat/completions", timeout=30,
                          json={"model": server.model, "messages": HELLO, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_forced_reply_is_calls_only_whatever_cuts_it(client, server):
    """tool_choice required: a stop string no longer cuts the call (a "\\n" had left
    the markup as content and no call; a "}" invalid arguments under "tool_calls"), and
    max_tokens cutting a call before its name leaves no markup in the content, streamed
    or not."""
    for seed in range(4):
        for stop in (["\n"], ["}"], ["get_weather", "add"]):
            reply = client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS, stop=stop,
                                                   tool_choice="required", temperature=1.0, seed=seed, max_tokens=300)
            assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
            check_calls(reply.choices[0].message.tool_calls)
    for max_tokens in (2, 3, 5, 8):
        ask = dict(model=server.model, messages=HELLO, tools=TOOLS, tool_choice="required", temperature=1.0,
                   seed=1, max_tokens=max_tokens)
        whole = client.chat.completions.create(**ask).choices[0]
        content, calls, finish = collect_stream(client.chat.completions.create(**ask, stream=True))
        assert whole.finish_reason == finish == "length"
        assert not whole.message.content and content == ""
        assert len(whole.message.tool_calls or []) == len(calls)


# ---- tool_choice auto: free until the model opens a call, then held to the tools --------------
def opening_bias(server, bias: float = 5.0) -> dict[str, float]:
    """logit_bias that makes the random model open calls now and then (it never would)."""
    opening = server.engine(lambda e: e.tokenizer.convert_tokens_to_ids("<tool_call>"))
    return {str(opening): bias}


def test_a_call_opened_under_auto_follows_the_tools(client, server):
    """A helper's pass: with a strict tool under auto, the model's opened calls had
    free arguments ('<tool_call><tool_call>% water...'); OpenAI's strict promises them
    valid, and llama.cpp's server holds them with a lazy grammar. Now: text, then calls
    to offered tools with valid arguments, then nothing; streamed the same."""
    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    called = texts = 0
    for seed in range(8):
        ask = dict(model=server.model, messages=HELLO, tools=strict, temperature=1.0, seed=seed, max_tokens=300,
                   logit_bias=opening_bias(server))
        reply = client.chat.completions.create(**ask).choices[0]
        if reply.message.tool_calls:
            called += 1
            assert reply.finish_reason == "tool_calls"
            check_calls(reply.message.tool_calls)
            assert "<tool_call>" not in (reply.message.content or "")
        else:
            texts += 1
            assert reply.finish_reason in ("stop", "length")
        content, calls, finish = collect_stream(client.chat.completions.create(**ask, stream=True))
        assert (content or None, finish) == (reply.message.content or None, reply.finish_reason)
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or []]
    assert called >= 3, (called, texts)


def test_a_stop_string_does_not_cut_a_call_opened_under_auto(client, server):
    """A helper's pass: under auto a stop string cut the calls the model opened ("}":
    arguments that are not JSON under finish_reason "tool_calls", which the openai SDK's
    parse refuses; "\n": the markup as content and no call). It applies to the text
    before the first call only, streamed or not."""
    called = 0
    for seed in range(6):
        for stop in (["}"], ["\n"], ["get_weather", "add"]):
            ask = dict(model=server.model, messages=HELLO, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=300,
                       stop=stop, logit_bias=opening_bias(server))
            reply = client.chat.completions.create(**ask).choices[0]
            assert "<tool_call>" not in (reply.message.content or "")
            if reply.message.tool_calls:
                called += 1
                assert reply.finish_reason == "tool_calls"
                check_calls(reply.message.tool_calls)
            content, calls, finish = collect_stream(client.chat.completions.create(**ask, stream=True))
            assert (content or None, finish) == (reply.message.content or None, reply.finish_reason)
            assert [(c["name"], c["arguments"]) for c in calls.values()] == \
                [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or []]
    assert called >= 6, called


def test_an_auto_call_cut_before_its_name_leaves_no_markup(client, server):
    """A helper's pass: max_tokens cutting a call the model opened under auto, before
    its name came out, left '<tool_call>\\n{"name":"' as the reply's content; the
    markup is dropped, streamed or not (as under a forced choice)."""
    cut = 0
    for seed in range(4):
        for max_tokens in (2, 3, 5, 8):
            ask = dict(model=server.model, messages=HELLO, tools=TOOLS, temperature=1.0, seed=seed,
                       max_tokens=max_tokens, logit_bias=opening_bias(server, 8.0))
            whole = client.chat.completions.create(**ask).choices[0]
            content, calls, finish = collect_stream(client.chat.completions.create(**ask, stream=True))
            assert "<tool_call>" not in (whole.message.content or "") and "<tool_call>" not in content
            assert (content or None, finish) == (whole.message.content or None, whole.finish_reason)
            cut += whole.finish_reason == "length" and not whole.message.tool_calls
    assert cut >= 4, cut


def test_without_a_call_an_auto_reply_is_the_free_one(client, server):
    """Until a call opens, the grammar allows every token but the marker: a reply that
    opens none is the unconstrained reply token for token (greedy, the same seed)."""
    ask = dict(model=server.model, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(messages=HELLO, tools=TOOLS, **ask).choices[0]
    prompt = server.engine(lambda e: e.tokenizer.apply_chat_template(
        HELLO, tools=TOOLS, add_generation_prompt=True, tokenize=False))
    free = client.completions.create(prompt=prompt, **ask).choices[0]   # the same prompt, no grammar
    assert not chat.message.tool_calls and chat.message.content == free.text.strip()   # the parser strips it


def test_an_auto_tool_schema_the_grammar_cannot_take(server):
    """Not strict: the calls go free, as before (it is the server's constraint, not the
    request's); strict: a 400 naming the tool, as for a forced call."""
    import httpx

    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "not": {}}}}
    body = {"model": server.model, "messages": HELLO, "max_tokens": 5, "tools": [*TOOLS, odd]}
    assert httpx.post(f"{server.base_url}/chat/completions", timeout=30, json=body).status_code == 200
    strict = {**odd, "function": {**odd["function"], "strict": True}}
    response = httpx.post(f"{server.base_url}/chat/completions", timeout=30, json={**body, "tools": [*TOOLS, strict]})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("the parameters schema of tool 'odd' cannot be enforced")
