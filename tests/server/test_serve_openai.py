"""The official openai SDK against the real server socket: chat and completions,
streaming and not, n, stop, seeds, usage, logprobs and prefix-cache accounting."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(60)

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)


def chat(client, server, **kwargs):
    kwargs.setdefault("messages", HELLO)
    return client.chat.completions.create(model=server.model, **kwargs)


def test_models_lists_every_served_name(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "org/tiny-model"]
    assert all(m.owned_by == "ruvllm" for m in models.data)


def test_a_model_is_retrieved_by_any_served_name(client, server):
    listed = {m.id: m for m in client.models.list().data}
    for name in ("tiny", "org/tiny-model"):   # a name with "/" too, as the SDK sends it
        model = client.models.retrieve(name)
        assert model.id == name and model == listed[name]
        assert model.status == "loaded" and model.max_model_len == 1024
    # Ollama's default tag names the model too, as on every route (it had been a 500)
    assert client.models.retrieve("tiny:latest") == listed["tiny"]
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("gpt-4o")
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and "'gpt-4o' does not exist" in \
        error["message"]


def test_chat_returns_a_message_with_real_usage(client, server):
    reply = chat(client, server, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == "tiny"
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    prompt_ids = server.engine(lambda e: e.tokenizer.apply_chat_template(
        HELLO, add_generation_prompt=True, tokenize=False))
    assert reply.usage.prompt_tokens == len(server.engine(lambda e: e.tokenizer.encode(
        prompt_ids, add_special_tokens=False)))
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_any_served_name_is_accepted_and_echoed(client, server):
    reply = client.chat.completions.create(model="org/tiny-model", messages=HELLO, max_tokens=2)
    assert reply.model == "org/tiny-model"
    # Ollama's default tag, as /api/tags lists the model (clients send that name here too)
    tagged = client.chat.completions.create(model=server.model + ":latest", messages=HELLO, max_tokens=2)
    assert tagged.model == server.model + ":latest"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=server.model + ":7b", messages=HELLO, max_tokens=2)


def test_chat_stream_matches_the_plain_reply(client, server):
    plain = chat(client, server, max_tokens=16, temperature=0)
    chunks = list(chat(client, server, max_tokens=16, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-1] == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_stream_include_usage_ends_with_a_usage_chunk(client, server):
    chunks = list(chat(client, server, max_tokens=10, temperature=0, stream=True,
                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_n_copies_use_consecutive_seeds(client, server):
    two = chat(client, server, n=2, max_tokens=12, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.completion_tokens == 24
    first = chat(client, server, max_tokens=12, temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    second = chat(client, server, max_tokens=12, temperature=1.0, seed=1235, extra_body={"ignore_eos": True})
    assert two.choices[0].message.content == first.choices[0].message.content
    assert two.choices[1].message.content == second.choices[0].message.content


def test_same_seed_same_text(client, server):
    replies = [chat(client, server, max_tokens=16, temperature=1.0, top_p=0.9, seed=7).choices[0].message.content
               for _ in range(2)]
    assert replies[0] == replies[1]


def test_n_streams_every_choice(client, server):
    chunks = list(chat(client, server, n=2, max_tokens=6, temperature=0, stream=True,
                       extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1]   # greedy: both copies agree


def test_stop_string_cuts_the_reply(client, server):
    full = chat(client, server, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}).choices[0]
    text = full.message.content
    start = next(i for i in range(2, len(text) - 1) if text[i:i + 2].isalnum())
    stop = text[start:start + 2]
    cut = chat(client, server, max_tokens=24, temperature=0, stop=[stop, "never-seen"],
               extra_body={"ignore_eos": True}).choices[0]
    assert cut.message.content == text[:text.index(stop)]
    assert cut.finish_reason == "stop"
    streamed = chat(client, server, max_tokens=24, temperature=0, stop=stop, stream=True,
                    extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text[:text.index(stop)]


def test_chat_logprobs(client, server):
    reply = chat(client, server, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
                 extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 8
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0 and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.token == item.top_logprobs[0].token   # greedy picks the most likely token
    raw = b"".join(bytes(item.bytes) for item in content)
    # A reply that ends inside a UTF-8 character shows the tokenizer's U+FFFD there
    # (one per byte), Python's decode one per sequence: compare what precedes them.
    text = reply.choices[0].message.content
    assert raw.decode("utf-8", errors="replace").rstrip("\ufffd") == text.rstrip("\ufffd")


def strict_json(text: str):
    """JSON as JavaScript, Go and Rust read it: no NaN or Infinity."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_tokens_a_grammar_rules_out_are_json(server, stream):
    """Fewer allowed tokens than top_logprobs asks for: the rest are -inf, which had gone
    out as a bare -Infinity (JSON.parse refused the reply); now vLLM's floor, -9999."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "pick"}], "max_tokens": 10,
            "temperature": 0, "logprobs": True, "top_logprobs": 5, "stream": stream,
            "structured_outputs": {"choice": ["alpha", "beta"]}}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200 and "Infinity" not in reply.text
    payloads = ([line[6:] for line in reply.text.splitlines() if line.startswith("data: {")] if stream
                else [reply.text])
    tops = [t for p in payloads for c in strict_json(p)["choices"] if c.get("logprobs")
            for item in c["logprobs"]["content"] for t in item["top_logprobs"]]
    assert len(tops) >= 5 and min(t["logprob"] for t in tops) == -9999.0   # the first token: 2 of 5 allowed
    completion = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": server.model, "prompt": "pick", "max_tokens": 4, "temperature": 0, "logprobs": 5,
        "structured_outputs": {"choice": ["alpha", "beta"]}})
    assert completion.status_code == 200 and "Infinity" not in completion.text
    strict_json(completion.text)


def test_chat_logprobs_stream_with_the_deltas(client, server):
    chunks = list(chat(client, server, max_tokens=6, temperature=0, logprobs=True, stream=True,
                       extra_body={"ignore_eos": True}))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == 6 and all(t.top_logprobs == [] for t in tokens)


def test_completion_plain_and_streamed(client, server):
    done = client.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=10,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 10
    streamed = client.completions.create(model=server.model, prompt="The quick brown fox", max_tokens=10,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_of_several_prompts_and_token_ids(client, server):
    ids = server.engine(lambda e: e.tokenizer.encode("Hello there"))
    done = client.completions.create(model=server.model, prompt=["The cat", "Hello there"], n=2, max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert done.usage.completion_tokens == 16
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == done.choices[2].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_completion_logprobs_and_echo(client, server):
    done = client.completions.create(model=server.model, prompt="Bread needs flour", max_tokens=5, temperature=0,
                                     logprobs=2, extra_body={"ignore_eos": True})
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert all(len(top) <= 3 and tok in top for tok, top in zip(logprobs.tokens, logprobs.top_logprobs))
    # Tokens that read alike share a top_logprobs entry: the chosen token's own value there,
    # the likeliest for the others (the least likely had won: greedy's token looked second)
    alike = client.completions.create(model=server.model, prompt="Once upon a time, a grey cat", max_tokens=8,
                                      temperature=0, logprobs=5, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert any("\ufffd" in token for token in alike.tokens)   # byte tokens, which read alike
    for token, value, top in zip(alike.tokens, alike.token_logprobs, alike.top_logprobs):
        assert top[token] == value and value == max(top.values())
    echoed = client.completions.create(model=server.model, prompt="Bread needs flour", max_tokens=5,
                                       temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "Bread needs flour" + done.choices[0].text


def test_completion_text_offsets_point_into_the_text_streamed_or_not(client, server):
    """A skipped special token takes no room in the text, a token that ends a character
    sits where the character begins, and the stream gives the same offsets."""
    pad = server.engine(lambda e: e.tokenizer.convert_tokens_to_ids("<|pad|>"))
    checked = 0
    for seed in range(4):
        ask = dict(model=server.model, prompt="Bread needs flour", max_tokens=12, temperature=1.0, seed=seed,
                   logprobs=0, logit_bias={str(pad): 4}, extra_body={"ignore_eos": True})
        whole = client.completions.create(**ask).choices[0]
        text, lp = whole.text, whole.logprobs
        assert lp.text_offset == sorted(lp.text_offset) and all(o <= len(text) for o in lp.text_offset)
        for token, offset in zip(lp.tokens, lp.text_offset):
            if not (token.startswith("<|") and token.endswith("|>")) and "\ufffd" not in token:   # skipped
                assert text.startswith(token, offset), (token, offset, text)
        streamed = [o for chunk in client.completions.create(**ask, stream=True) for c in chunk.choices
                    if c.logprobs for o in c.logprobs.text_offset]
        assert streamed == lp.text_offset
        # a stop string holds back a tail that could start it: the offsets must not lag behind
        # it (they had: [0, 1, 2, 5] for [0, 1, 3, 6])
        cut = next((i for i in range(2, len(text) - 3) if text.find(text[i:i + 3]) == i
                    and i not in lp.text_offset), None)
        if cut is None:
            continue
        stopped = client.completions.create(**ask, stop=text[cut:cut + 3]).choices[0]
        assert stopped.text == text[:cut] and stopped.finish_reason == "stop"
        shown = len(stopped.logprobs.text_offset)
        assert stopped.logprobs.text_offset == lp.text_offset[:shown], (text, cut)
        checked += 1
    assert checked


def test_repeated_long_prompt_reports_cached_tokens(client, server):
    unique = uuid.uuid4().hex
    long_prompt = f"{unique} " + "Computers store numbers in binary. A byte has eight bits. " * 20
    messages = [{"role": "user", "content": long_prompt}]
    first = chat(client, server, messages=messages, max_tokens=2)
    second = chat(client, server, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens > 200
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached >= first.usage.prompt_tokens - 16


def test_cache_salt_keeps_tenants_apart(client, server):
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "Tenants share a server. " * 20}]
    first = chat(client, server, messages=messages, max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    other = chat(client, server, messages=messages, max_tokens=2, extra_body={"cache_salt": "tenant-b"})
    same = chat(client, server, messages=messages, max_tokens=2, extra_body={"cache_salt": "tenant-a"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert same.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


def test_penalties_and_text_parts_are_accepted(client, server):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Tell me more."}]
    reply = chat(client, server, messages=messages, max_tokens=5, presence_penalty=1.5, frequency_penalty=0.5,
                 temperature=0.7, seed=3)
    assert reply.choices[0].message.content is not None
    assert reply.usage.completion_tokens <= 5


def test_default_max_tokens_is_what_the_context_leaves(server, client):
    limit = server.engine(lambda e: e.max_model_len)
    ids = [10 + i % 400 for i in range(limit - 5)]
    done = client.completions.create(model=server.model, prompt=ids, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    short = client.completions.create(model=server.model, prompt="Hello", temperature=0,
                                      extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16   # OpenAI's default for completions


def test_a_tool_conversation_renders_through_the_template(client, server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"}]
    reply = chat(client, server, messages=messages, max_tokens=3)
    assert reply.choices[0].message.role == "assistant"
    rendered = server.engine(lambda e: e.tokenizer.apply_chat_template(
        [messages[0], {**messages[1], "tool_calls": [{"function": {"name": "get_weather",
                                                                   "arguments": {"city": "Paris"}}}]},
         messages[2]], add_generation_prompt=True, tokenize=False))
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert reply.usage.prompt_tokens == len(server.engine(lambda e: e.tokenizer.encode(
        rendered, add_special_tokens=False)))


def test_an_assistant_s_refusal_passed_back_is_its_text(client, server):
    """OpenAI's replies carry a refusal as `refusal` (content null) or a `refusal` part;
    clients append them to the history as they came (it was a 400: "only text parts")."""
    def prompt_of(assistant):
        messages = [{"role": "user", "content": "x"}, assistant, {"role": "user", "content": "y"}]
        return chat(client, server, messages=messages, max_tokens=1).usage.prompt_tokens

    as_text = prompt_of({"role": "assistant", "content": "I can't help with that."})
    assert prompt_of({"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}) \
        == as_text
    assert prompt_of({"role": "assistant", "content": None, "refusal": "I can't help with that."}) == as_text
    with pytest.raises(openai.BadRequestError, match="only text content parts"):
        chat(client, server, messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],
             max_tokens=1)
