"""Reasoning models over the real socket: the reasoning split from the answer on the
chat route (`reasoning` / `reasoning_content`), Anthropic's thinking blocks and the
Responses API's reasoning items, streamed or whole, through the official SDKs.

Two tiny reasoning models (THINK_TOKENS added, `reasoning_template`): one whose
template opens the <think> block in the generation prompt (DeepSeek-R1, QwQ), one
whose model opens it (Qwen3). Random weights write no marker on their own, so
logit_bias makes </think> (and <think>) likely; the reference for every reply is the
same prompt's raw text from /v1/completions with the same seed, split by hand."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.reasoning import FORMATS, split_reasoning
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.testing.tiny_model import THINK_END, THINK_START

from tests.server.conftest import build_server

pytestmark = pytest.mark.timeout(240)

HELLO = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK = FORMATS["think"]
SEEDS = range(12)


@pytest.fixture(scope="module", params=["opens", "model"])
def reasoning_server(request, make_tiny_model):
    path = make_tiny_model(reasoning=request.param)
    live = build_server(load_model(path, "cpu", Quantization.F32))
    live.mode = request.param
    yield live
    live.stop()


@pytest.fixture(scope="module")
def opens_server(make_tiny_model):
    live = build_server(load_model(make_tiny_model(reasoning="opens"), "cpu", Quantization.F32))
    yield live
    live.stop()


def content_of(message: dict) -> str:
    """The answer: null where a reasoning model's reply has none beside its reasoning (vLLM's)."""
    if message["content"] is None:
        assert message["reasoning"] or message.get("tool_calls"), message
        return ""
    assert message["content"] or not message["reasoning"], "an empty answer after reasoning is null"
    return message["content"]


def client_of(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)


def ids_of(live, *tokens: str) -> list[int]:
    return live.engine(lambda e: e.tokenizer.convert_tokens_to_ids(list(tokens)))


def bias_for(live, mode: str = "opens") -> dict[str, float]:
    """</think> likely enough to close most replies within their tokens (and, where the
    model opens the block, <think> likely as its first token)."""
    start, end = ids_of(live, THINK_START, THINK_END)
    return {str(end): 3.5} if mode == "opens" else {str(start): 7.0, str(end): 5.0}


def raw_reply(live, messages, **ask):
    """The same prompt's reply with no parsing: its text and its tokens' texts."""
    prompt = live.engine(lambda e: e.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False,
        **ask.pop("chat_template_kwargs", {})))
    reply = client_of(live).completions.create(model=live.model, prompt=list(prompt), logprobs=0, **ask)
    return reply.choices[0].text, reply.choices[0].logprobs.tokens


def chat_stream(stream):
    reasoning = content = ""
    usage = finish = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish, usage


def test_the_reasoning_is_split_from_the_answer_streamed_or_not(reasoning_server):
    live, client = reasoning_server, client_of(reasoning_server)
    kinds = set()
    for seed in SEEDS:
        ask = dict(temperature=1.0, seed=seed, max_tokens=24, logit_bias=bias_for(live, live.mode))
        raw, tokens = raw_reply(live, HELLO, **ask)
        expected = split_reasoning(THINK, raw, in_reasoning=live.mode == "opens")
        whole = client.chat.completions.create(model=live.model, messages=HELLO, **ask)
        message = whole.choices[0].message.model_dump()
        assert (message["reasoning"] or "", content_of(message)) == (expected.reasoning, expected.content), raw
        assert message["reasoning_content"] == message["reasoning"]
        assert THINK_END not in content_of(message) or expected.content.count(THINK_END) > 0
        # reasoning tokens: up to and with </think>, or all of them where the block never closed
        spent = tokens.index(THINK_END) + 1 if THINK_END in tokens else len(tokens)
        had = live.mode == "opens" or raw.lstrip().startswith(THINK_START)
        assert whole.usage.completion_tokens_details.reasoning_tokens == (spent if had else 0)
        streamed = chat_stream(client.chat.completions.create(
            model=live.model, messages=HELLO, stream=True, stream_options={"include_usage": True}, **ask))
        assert streamed[:2] == (expected.reasoning, expected.content)
        assert streamed[2] == whole.choices[0].finish_reason
        assert streamed[3].completion_tokens_details.reasoning_tokens == (spent if had else 0)
        kinds.add((bool(expected.reasoning), bool(expected.content)))
        document = httpx.get(live.url + "/openapi.json", timeout=10).json()
        jsonschema.validate(whole.model_dump(exclude_unset=True),
                            {"$ref": "#/components/schemas/ChatCompletion", "components": document["components"]})
    assert (True, True) in kinds   # some replies closed their block and answered
    live.assert_clean()


def test_include_reasoning_false_leaves_it_out(opens_server):
    client = client_of(opens_server)
    answered = 0
    for seed in SEEDS:
        ask = dict(temperature=1.0, seed=seed, max_tokens=24, logit_bias=bias_for(opens_server))
        raw, _ = raw_reply(opens_server, HELLO, **ask)
        reply = client.chat.completions.create(model=opens_server.model, messages=HELLO,
                                               extra_body={"include_reasoning": False}, **ask)
        message = reply.choices[0].message.model_dump()
        assert "reasoning" not in message and "reasoning_content" not in message
        answer = split_reasoning(THINK, raw, True).content
        assert message["content"] == (answer or None)   # no answer beside the reasoning: null
        streamed = chat_stream(client.chat.completions.create(model=opens_server.model, messages=HELLO,
                                                              stream=True, extra_body={"include_reasoning": False},
                                                              **ask))
        assert streamed[:2] == ("", answer)
        answered += bool(answer)
    assert answered >= 2


def test_thinking_turned_off_in_the_template_leaves_the_reply_all_answer(opens_server):
    """Qwen3's enable_thinking false closes an empty block in the prompt: nothing is reasoning."""
    ask = dict(temperature=1.0, seed=1, max_tokens=16, chat_template_kwargs={"enable_thinking": False})
    raw, _ = raw_reply(opens_server, HELLO, **dict(ask))
    reply = client_of(opens_server).chat.completions.create(
        model=opens_server.model, messages=HELLO, temperature=1.0, seed=1, max_tokens=16,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message.model_dump()
    expected = split_reasoning(THINK, raw, in_reasoning=False)   # the model may still open a block itself
    assert (message["reasoning"] or "", content_of(message)) == (expected.reasoning, expected.content)
    assert not raw.startswith(THINK_START) or reply.usage.completion_tokens_details.reasoning_tokens > 0
    for seed in range(6):   # a reply that does not open one is all answer
        ask = dict(temperature=1.0, seed=seed, max_tokens=8, chat_template_kwargs={"enable_thinking": False})
        raw, _ = raw_reply(opens_server, HELLO, **dict(ask))
        if raw.lstrip().startswith(THINK_START):
            continue
        reply = client_of(opens_server).chat.completions.create(
            model=opens_server.model, messages=HELLO, temperature=1.0, seed=seed, max_tokens=8,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        message = reply.choices[0].message.model_dump()
        assert message["reasoning"] is None and message["content"] == raw
        assert reply.usage.completion_tokens_details.reasoning_tokens == 0
        return
    raise AssertionError("every seed opened a block")


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 8}}}


def test_with_thinking_turned_off_a_constraint_holds_from_the_first_token(make_tiny_model):
    """The template closed the block in the prompt: the schema applies at once. It used to
    let the first token open a new block (<think> made likely here) and then wait for a
    </think> that never came: all 30 tokens reasoning, no JSON."""
    live = build_server(load_model(make_tiny_model(reasoning="model"), "cpu", Quantization.F32))
    try:
        client = client_of(live)
        [start] = ids_of(live, THINK_START)
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
        for seed in range(3):
            reply = client.chat.completions.create(
                model=live.model, messages=HELLO, temperature=1.0, seed=seed, max_tokens=40, response_format=fmt,
                logit_bias={str(start): 8.0}, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            message = reply.choices[0].message
            assert message.model_dump()["reasoning"] is None
            assert message.content.startswith("{")
            if reply.choices[0].finish_reason == "stop":
                jsonschema.validate(json.loads(message.content), SCHEMA)
    finally:
        live.stop()


def test_a_constraint_waits_for_the_end_of_the_reasoning(reasoning_server):
    """response_format on a reasoning model's reply: the reasoning is what the model writes
    unconstrained (the same tokens as without the schema), the answer after </think>
    follows the schema. Where the model opens the block itself (Qwen3), its first token
    may be <think> under the constraint too."""
    live = reasoning_server
    client = client_of(live)
    answered = reasoned = 0
    for seed in SEEDS:
        ask = dict(model=live.model, messages=HELLO, temperature=1.0, seed=seed, max_tokens=60,
                   logit_bias=bias_for(live, live.mode))
        free_choice = client.chat.completions.create(**ask).choices[0]
        free = free_choice.message.model_dump()
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
        reply = client.chat.completions.create(**ask, response_format=fmt).choices[0]
        message = reply.message.model_dump()
        if live.mode == "opens" or free["reasoning"]:   # else the mask made <think> likelier than unmasked
            if free_choice.finish_reason == "stop" and free["content"] is None:
                # the free reply ended inside its block, where the constraint holds EOS off
                assert message["reasoning"].startswith(free["reasoning"])
            else:
                assert message["reasoning"] == free["reasoning"]
        reasoned += bool(message["reasoning"])
        if reply.finish_reason == "stop":
            jsonschema.validate(json.loads(message["content"]), SCHEMA)
            answered += 1
    assert answered >= 3 and reasoned >= 3
    live.assert_clean()


def test_a_forced_tool_call_comes_after_the_reasoning(opens_server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    client = client_of(opens_server)
    called = 0
    for seed in SEEDS:
        reply = client.chat.completions.create(model=opens_server.model, messages=HELLO, tools=tools,
                                               tool_choice="required", temperature=1.0, seed=seed, max_tokens=80,
                                               logit_bias=bias_for(opens_server)).choices[0]
        if reply.finish_reason == "tool_calls":
            called += 1
            assert reply.message.model_dump()["reasoning"]
            [call] = reply.message.tool_calls[:1]
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
            assert not reply.message.content
    assert called >= 3


def test_under_auto_a_reasoning_model_reasons_then_its_calls_follow_the_tool(opens_server):
    """tool_choice auto holds calls to the tools once the model opens one after its
    reasoning; the reasoning stays free (a marker written in it is reasoning text, as
    without the grammar) and apart."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    client = client_of(opens_server)
    opening = opens_server.engine(lambda e: e.tokenizer.convert_tokens_to_ids("<tool_call>"))
    called = 0
    for seed in SEEDS:
        reply = client.chat.completions.create(
            model=opens_server.model, messages=HELLO, tools=tools, temperature=1.0, seed=seed, max_tokens=120,
            logit_bias={**bias_for(opens_server), str(opening): 3.0}).choices[0]
        message = reply.message.model_dump()
        if reply.finish_reason != "length":   # a call cut before its name stays text (ToolReplies.settle)
            assert "<tool_call>" not in (message["content"] or "")
        if reply.finish_reason == "tool_calls":
            called += 1
            for call in reply.message.tool_calls:
                assert call.function.name == "get_weather"
                jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert called >= 3


def test_continuing_an_assistant_message_inside_its_block_continues_the_reasoning(reasoning_server):
    live, client = reasoning_server, client_of(reasoning_server)
    turns = [*HELLO, {"role": "assistant", "content": "<think>\nLet me see"}]
    prompt = live.engine(lambda e: e.tokenizer.apply_chat_template(
        turns, continue_final_message=True, tokenize=True, return_dict=False))
    closed = 0
    for seed in range(4):
        ask = dict(temperature=1.0, seed=seed, max_tokens=24, logit_bias=bias_for(live))
        raw = client.completions.create(model=live.model, prompt=list(prompt), **ask).choices[0].text
        expected = split_reasoning(THINK, raw, in_reasoning=True)
        reply = client.chat.completions.create(model=live.model, messages=turns, **ask, extra_body={
            "continue_final_message": True, "add_generation_prompt": False})
        message = reply.choices[0].message.model_dump()
        assert (message["reasoning"] or "", content_of(message)) == (expected.reasoning, expected.content)
        closed += bool(expected.content)
    assert closed


def test_earlier_reasoning_reaches_the_template(opens_server):
    """An assistant turn's reasoning (either name) is rendered in its <think> block."""
    client = client_of(opens_server)

    def prompt_tokens(**extra):
        turns = [*HELLO, {"role": "assistant", "content": "Sunny.", **extra}, {"role": "user", "content": "And?"}]
        return client.chat.completions.create(model=opens_server.model, messages=turns, max_tokens=1).usage \
            .prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(reasoning="the weather is sunny there") > plain
    assert prompt_tokens(reasoning_content="the weather is sunny there") == prompt_tokens(
        reasoning="the weather is sunny there")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=opens_server.model, max_tokens=1,
                                       messages=[{"role": "user", "content": "hi", "reasoning": "no"}])
    assert error.value.body["param"] == "messages[0].reasoning"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=opens_server.model, max_tokens=1, messages=[
            *HELLO, {"role": "assistant", "content": "x", "reasoning_content": ["no"]}, *HELLO])
    assert error.value.body["param"] == "messages[1].reasoning_content"   # the field the client sent


# ---- Anthropic's Messages API ----------------------------------------------------------
def test_thinking_blocks_when_thinking_is_asked(opens_server):
    client = anthropic.Anthropic(base_url=opens_server.url, api_key="unused", max_retries=0, timeout=60)
    for seed in range(4):
        ask = dict(model=opens_server.model, max_tokens=24, messages=HELLO,
                   extra_body={"temperature": 1.0, "seed": seed, "logit_bias": bias_for(opens_server)})
        raw, _ = raw_reply(opens_server, HELLO, temperature=1.0, seed=seed, max_tokens=24,
                           logit_bias=bias_for(opens_server))
        expected = split_reasoning(THINK, raw, True)
        plain = client.messages.create(**ask)
        assert [b.type for b in plain.content] == (["text"] if expected.content else [])
        thinking = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
        blocks = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in thinking.content]
        wanted = ([("thinking", expected.reasoning)] if expected.reasoning else []) + (
            [("text", expected.content)] if expected.content else [])
        assert blocks == wanted
        document = httpx.get(opens_server.url + "/openapi.json", timeout=10).json()
        jsonschema.validate(thinking.model_dump(exclude_unset=True),
                            {"$ref": "#/components/schemas/Message", "components": document["components"]})
        with client.messages.stream(**ask, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            streamed = stream.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content] == wanted
    # a past turn's thinking block goes back to the template as its reasoning
    turns = [*HELLO, {"role": "assistant", "content": [{"type": "thinking", "thinking": "sunny, I think",
                                                         "signature": "x"}, {"type": "text", "text": "Sunny."}]},
             {"role": "user", "content": "And?"}]
    without = [*HELLO, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And?"}]
    count = [client.messages.create(model=opens_server.model, max_tokens=1, messages=m).usage.input_tokens
             for m in (turns, without)]
    assert count[0] > count[1]


# ---- OpenAI's Responses API -------------------------------------------------------------
def test_a_reasoning_item_before_the_message(opens_server):
    client = client_of(opens_server)
    for seed in range(4):
        ask = dict(model=opens_server.model, input=HELLO, max_output_tokens=24, temperature=1.0,
                   extra_body={"seed": seed, "logit_bias": bias_for(opens_server)})
        raw, tokens = raw_reply(opens_server, HELLO, temperature=1.0, seed=seed, max_tokens=24,
                                logit_bias=bias_for(opens_server))
        expected = split_reasoning(THINK, raw, True)
        reply = client.responses.create(**ask)
        kinds = [item.type for item in reply.output]
        assert kinds == (["reasoning"] if expected.reasoning else []) + ["message"]
        if expected.reasoning:
            assert reply.output[0].content[0].text == expected.reasoning
        assert reply.output_text == expected.content
        spent = tokens.index(THINK_END) + 1 if THINK_END in tokens else len(tokens)
        assert reply.usage.output_tokens_details.reasoning_tokens == spent
        with client.responses.stream(**ask) as stream:
            events = list(stream)
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        final = events[-1].response   # response.completed or .incomplete (the token limit)
        done = [e.item for e in events if e.type == "response.output_item.done"]
        assert [item.type for item in done] == kinds
        assert deltas == expected.reasoning
        assert [item.type for item in final.output] == kinds and final.output_text == expected.content
    # a reasoning item in the input opens the assistant turn that follows it
    item = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "sunny, I think"}]}
    answer = {"role": "assistant", "content": "Sunny."}
    counts = [client.responses.create(model=opens_server.model, max_output_tokens=1,
                                      input=[*HELLO, *turn, {"role": "user", "content": "And?"}]).usage.input_tokens
              for turn in ([item, answer], [answer])]
    assert counts[0] > counts[1]


def test_reasoning_items_join_the_turn_they_open():
    from ruvllm_cli.server.errors import ApiError
    from ruvllm_cli.server.responses_api.items import parse_input

    def reasoning(text):
        return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}

    user, answer = {"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}
    assert parse_input([user, reasoning("a"), reasoning("b"), answer, user])[1] == {
        "role": "assistant", "content": "x", "reasoning_content": "a\nb"}
    assert parse_input([user, answer, reasoning("orphan"), user]) == [user, answer, user]   # no turn of its own
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    [_, turn] = parse_input([user, reasoning("a"), call])
    assert turn["reasoning_content"] == "a" and turn["tool_calls"][0]["id"] == "c"
    with pytest.raises(ApiError):
        parse_input([reasoning("alone")])


def test_anthropics_budget_tokens_ends_the_thinking_there(opens_server):
    """budget_tokens: at most that many tokens of reasoning, then the model's end marker
    is forced and it answers (the same seed writes the same reasoning up to the cut)."""
    client = anthropic.Anthropic(base_url=opens_server.url, api_key="unused", max_retries=0, timeout=60)
    for seed in range(3):
        _, tokens = raw_reply(opens_server, HELLO, temperature=1.0, seed=seed, max_tokens=24)
        reply = client.messages.create(model=opens_server.model, max_tokens=24, messages=HELLO,
                                       thinking={"type": "enabled", "budget_tokens": 4},
                                       extra_body={"temperature": 1.0, "seed": seed})
        blocks = {b.type: getattr(b, "thinking", None) or getattr(b, "text", None) for b in reply.content}
        if THINK_END in tokens[:5]:
            continue   # it closed the block on its own within the budget
        assert blocks["thinking"] == split_reasoning(THINK, "".join(tokens[:4]), True).reasoning
        assert blocks.get("text") and reply.stop_reason in ("end_turn", "max_tokens")


def test_a_constrained_reply_cannot_end_inside_its_reasoning(opens_server):
    """EOS is held while a constraint waits out the block: a reply that ended there had
    no answer at all (finish_reason stop, content empty, under a strict schema)."""
    live = opens_server
    eos = live.engine(lambda e: sorted(e.loaded.eos_token_ids))[0]
    [end] = ids_of(live, THINK_END)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    ended_free = False
    for seed in range(4):
        ask = dict(model=live.model, messages=HELLO, temperature=1.0, seed=seed, max_tokens=60,
                   logit_bias={str(eos): 6.0, str(end): 2.0})
        free = client_of(live).chat.completions.create(**ask).choices[0]
        ended_free |= free.finish_reason == "stop" and not free.message.content
        reply = client_of(live).chat.completions.create(**ask, response_format=fmt).choices[0]
        if reply.finish_reason == "stop":
            jsonschema.validate(json.loads(reply.message.content), SCHEMA)
    assert ended_free   # without a constraint, such replies do end inside the block
    live.assert_clean()
