"""vLLM's chat-template fields (chat_template_kwargs, add_generation_prompt,
continue_final_message), and an assistant message with calls and no content, which
Qwen3's template reads as text (it had been a 400 in the openai SDK's tool loop)."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from ruvllm_cli.engine.chat_template import render_chat
from ruvllm_cli.errors import UsageError

pytestmark = pytest.mark.timeout(120)
HELLO = [{"role": "user", "content": "Tell me a story."}]


def test_template_variables_and_a_call_without_content_reach_the_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = ("{% for m in messages %}{% if '</think>' in m.content %}T{% endif %}"
                               "{{ m.content }};{% endfor %}{% if enable_thinking is defined and not enable_thinking %}"
                               "<think></think>{% endif %}")
    calls = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {}}}]}]
    plain = tokenizer.decode(render_chat(tokenizer, HELLO + calls))
    assert plain == "Tell me a story.;;"   # content None read as "" (Qwen3's `in message.content`)
    off = tokenizer.decode(render_chat(tokenizer, HELLO, template_kwargs={"enable_thinking": False}))
    assert off == "Tell me a story.;<think></think>"
    tokenizer.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(UsageError, match="rejected the messages: no system role"):
        render_chat(tokenizer, HELLO)


def post(server, body):
    return httpx.post(f"{server.base_url}/chat/completions", timeout=30,
                      json={"model": server.model, "max_tokens": 2, **body})


def test_continue_final_message_continues_instead_of_opening_a_turn(server):
    messages = [*HELLO, {"role": "assistant", "content": "Once upon a time"}]
    opened = post(server, {"messages": messages})
    continued = post(server, {"messages": messages, "add_generation_prompt": False, "continue_final_message": True})
    assert opened.status_code == continued.status_code == 200, continued.text
    # no end of turn after the assistant's text, and no new assistant turn
    assert continued.json()["usage"]["prompt_tokens"] < opened.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
])
def test_template_fields_the_server_cannot_take_are_400s(server, body, param):
    response = post(server, {"messages": HELLO, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
