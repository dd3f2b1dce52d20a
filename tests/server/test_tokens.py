"""Counting without generating over the real socket: vLLM's /tokenize and /detokenize,
Anthropic's /v1/messages/count_tokens through the official SDK. A count is the prompt
tokens the same request is billed on the generating route."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from ruvllm_cli.testing.api_errors import assert_error
from tests.server.test_tools import TOOLS

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! How are you today?"}]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def tokenize(server, **body) -> dict:
    response = httpx.post(server.url + "/tokenize", json={"model": server.model, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prompt_s_count_is_what_a_completion_is_billed(server, client):
    prompt = "the quick brown fox jumps over the lazy dog"
    counted = tokenize(server, prompt=prompt, return_token_strs=True)
    billed = client.completions.create(model=server.model, prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert counted["count"] == len(counted["tokens"]) == billed and counted["max_model_len"] == 1024
    assert len(counted["token_strs"]) == billed and "".join(counted["token_strs"]).endswith("lazy dog")
    back = httpx.post(server.url + "/detokenize", json={"model": server.model, "tokens": counted["tokens"]},
                      timeout=60).json()
    assert back["prompt"].endswith(prompt)


def test_a_conversation_s_count_is_what_a_chat_request_is_billed(server, client):
    plain = tokenize(server, messages=HELLO)
    assert plain["token_strs"] is None
    assert plain["count"] == client.chat.completions.create(model=server.model, messages=HELLO,
                                                            max_tokens=1).usage.prompt_tokens
    with_tools = tokenize(server, messages=HELLO, tools=TOOLS)
    assert with_tools["count"] > plain["count"]
    assert with_tools["count"] == client.chat.completions.create(model=server.model, messages=HELLO, tools=TOOLS,
                                                                 max_tokens=1).usage.prompt_tokens
    open_turn = tokenize(server, messages=HELLO, add_generation_prompt=False)
    assert open_turn["count"] < plain["count"]


def test_count_tokens_is_a_messages_request_s_input(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "description": "x", "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    ask = {"model": server.model, "system": "Be brief.", "messages": [{"role": "user", "content": "Hello!"}]}
    # tool_choice none leaves the tools out of the prompt: the count must too (it had counted them)
    for extra in ({}, {"tools": tools}, {"tools": tools, "tool_choice": {"type": "none"}},
                  {"tools": tools, "tool_choice": {"type": "tool", "name": tools[0]["name"]}}):
        counted = client.messages.count_tokens(**ask, **extra).input_tokens
        usage = client.messages.create(**ask, **extra, max_tokens=1).usage
        assert counted == usage.input_tokens + usage.cache_read_input_tokens
    bare = client.messages.count_tokens(**ask).input_tokens
    assert client.messages.count_tokens(**ask, tools=tools, tool_choice={"type": "none"}).input_tokens == bare
    assert client.messages.count_tokens(**ask, tools=tools).input_tokens > bare
    for bad in ({"messages": []}, {"messages": ask["messages"], "tool_choice": {"type": "any"}},
                {"messages": ask["messages"], "tools": tools, "tool_choice": {"type": "tool", "name": "nope"}}):
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.count_tokens(model=server.model, **bad)
        assert refused.value.body["type"] == "error"


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": HELLO}, "prompt"),
    ("/tokenize", {"messages": HELLO, "continue_final_message": True}, "continue_final_message"),
    # the chat route's rule: only the assistant's last message is continued (it was counted as if)
    ("/tokenize", {"messages": HELLO, "continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_requests_are_400s_naming_their_field(server, path, body, param):
    assert_error(httpx.post(server.url + path, json={"model": server.model, **body}, timeout=60), 400, param)


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_an_unknown_model_is_a_404(server, path):
    body = {"model": "nope", "prompt": "a", "tokens": [1]}
    assert_error(httpx.post(server.url + path, json=body, timeout=60), 404, "model", "model_not_found")
