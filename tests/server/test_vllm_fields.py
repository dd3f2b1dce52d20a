"""vLLM's sampling fields beyond OpenAI's, which vLLM clients send through extra_body:
min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens (each had
been dropped as unknown: a 200 that ignored it), and the 400s for what is not served
(prompt_logprobs, a priority under fcfs, stream_options without stream, a token id
given twice in logit_bias)."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def eos(server) -> int:
    return server.engine(lambda e: e.loaded.eos_token_ids[0])


def test_min_tokens_holds_off_eos(client, server):
    forced_eos = {"logit_bias": {str(eos(server)): 100}, "temperature": 0, "max_tokens": 10}
    at_once = client.completions.create(model=server.model, prompt="hello world", **forced_eos)
    assert at_once.usage.completion_tokens == 1 and at_once.choices[0].finish_reason == "stop"
    held = client.completions.create(model=server.model, prompt="hello world", **forced_eos,
                                     extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


def test_logprobs_are_the_models_before_logit_bias_and_min_tokens(client, server):
    """They had been taken after logit_bias and min_tokens (and before temperature and
    the penalties): two conventions in one figure."""
    ask = dict(model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=1, temperature=0,
               logprobs=True, top_logprobs=5)
    plain = client.chat.completions.create(**ask).choices[0].logprobs.content[0]
    third = plain.top_logprobs[2]
    token = server.engine(lambda e: e.tokenizer.convert_tokens_to_ids(third.token))
    biased = client.chat.completions.create(**ask, logit_bias={str(token): 100}).choices[0].logprobs.content[0]
    assert biased.token == third.token and biased.logprob == pytest.approx(third.logprob, abs=1e-5)
    assert [t.logprob for t in biased.top_logprobs] == pytest.approx([t.logprob for t in plain.top_logprobs],
                                                                     abs=1e-5)
    held = client.chat.completions.create(**ask, extra_body={"min_tokens": 1, "temperature": 0.5,
                                                             "repetition_penalty": 1.5}).choices[0].logprobs
    assert [t.logprob for t in held.content[0].top_logprobs] == pytest.approx(
        [t.logprob for t in plain.top_logprobs], abs=1e-5)


def test_stop_token_ids_end_the_reply(client, server):
    token = server.engine(lambda e: e.tokenizer.encode("the")[0])
    reply = client.completions.create(model=server.model, prompt="x", max_tokens=8, temperature=0,
                                      logit_bias={str(token): 100}, extra_body={"stop_token_ids": [token]})
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 1
    assert reply.choices[0].text == ""
    # vLLM keeps the stop token's text with include_stop_str_in_output (its
    # detokenizer leaves the token out only without it); it had been dropped either way
    kept = client.completions.create(model=server.model, prompt="x", max_tokens=8, temperature=0,
                                     logit_bias={str(token): 100},
                                     extra_body={"stop_token_ids": [token], "include_stop_str_in_output": True})
    assert kept.choices[0].finish_reason == "stop" and kept.usage.completion_tokens == 1
    assert kept.choices[0].text == server.engine(lambda e: e.tokenizer.decode([token])) != ""


def test_include_stop_str_in_output_streamed_or_not(client, server):
    ask = dict(model=server.model, prompt="Once upon a time", max_tokens=24, temperature=0)
    text = client.completions.create(**ask, extra_body={"ignore_eos": True}).choices[0].text
    stop = text[6:9]
    assert len(stop) == 3 and stop.strip()
    cut = client.completions.create(**ask, stop=[stop], extra_body={"ignore_eos": True}).choices[0].text
    include = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = client.completions.create(**ask, stop=[stop], extra_body=include)
    assert kept.choices[0].text == cut + stop and kept.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**ask, stop=[stop], stream=True, extra_body=include)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut + stop


def test_skip_special_tokens_false_keeps_them_in_the_text(client, server):
    special = eos(server)
    marker = server.engine(lambda e: e.tokenizer.decode([special], skip_special_tokens=False))
    ask = dict(model=server.model, prompt="x", max_tokens=2, temperature=0, logit_bias={str(special): 100})
    skipped = client.completions.create(**ask, extra_body={"ignore_eos": True})
    kept = client.completions.create(**ask, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert marker not in skipped.choices[0].text and kept.choices[0].text == marker * 2


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"priority": 5}, "priority"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"logit_bias": {"65": 2, "065": 2}}, "logit_bias"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"stop_token_ids": [10 ** 9]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
])
def test_what_is_not_served_is_a_400(server, body, param):
    payload = {"model": server.model, "prompt": "hello", "max_tokens": 4, **body}
    response = httpx.post(f"{server.base_url}/completions", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
