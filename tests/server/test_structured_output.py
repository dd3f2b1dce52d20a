"""Structured output through the official openai SDK over the real socket:
response_format json_schema / json_object, vLLM's structured_outputs (regex, choice),
logit_bias, n=2, streaming, json repair and the 400s (issue 19)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "Describe a person."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_json_schema_replies_validate_with_n_2(client, server):
    reply = client.chat.completions.create(model=server.model, messages=HELLO, response_format=SCHEMA_FORMAT,
                                           temperature=1.0, seed=11, n=2, max_tokens=200)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_schema_streams_valid_json(client, server):
    stream = client.chat.completions.create(model=server.model, messages=HELLO, response_format=SCHEMA_FORMAT,
                                            temperature=1.0, seed=5, n=2, max_tokens=200, stream=True)
    texts, finish = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_on_both_endpoints(client, server):
    chat = client.chat.completions.create(model=server.model, messages=HELLO, max_tokens=80, seed=1,
                                          response_format={"type": "json_object"})
    done = client.completions.create(model=server.model, prompt="{", max_tokens=80, seed=1,
                                     extra_body={"response_format": {"type": "json_object"}})
    for text, reason in ((chat.choices[0].message.content, chat.choices[0].finish_reason),
                         (done.choices[0].text, done.choices[0].finish_reason)):
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_regex_and_choice_as_vllm_takes_them(client, server):
    regex = client.completions.create(model=server.model, prompt="Code:", max_tokens=30, seed=2,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.choices[0].text)
    choice = client.chat.completions.create(model=server.model, messages=HELLO, max_tokens=30, seed=2,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    assert choice.choices[0].finish_reason == "stop"


def test_cut_reply_says_length_and_repair_closes_it(client, server):
    schema_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": False}}
    cut = client.chat.completions.create(model=server.model, messages=HELLO, response_format=schema_format,
                                         max_tokens=4, seed=3)
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(cut.choices[0].message.content)
    repaired = client.chat.completions.create(model=server.model, messages=HELLO, response_format=schema_format,
                                              max_tokens=4, seed=3, extra_body={"ruvllm": {"json_repair": True}})
    choice = repaired.choices[0]
    assert choice.finish_reason == "length"
    assert isinstance(json.loads(choice.message.content), dict)
    assert choice.model_extra["ruvllm"] == {"json_repaired": True}


def test_logit_bias_forces_a_token(client, server):
    token = server.engine(lambda e: e.tokenizer.encode("the")[0])
    reply = client.completions.create(model=server.model, prompt="x", max_tokens=3, temperature=1.0, seed=0,
                                      logit_bias={str(token): 100})
    assert reply.choices[0].text == server.engine(lambda e: e.tokenizer.decode([token] * 3))


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "not": {"required": ["a"]}}}}}, "response_format", "not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "regular expression"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ""),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias", "token ids"),
    ({"logit_bias": {"12": 101}}, "logit_bias.12", "100"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
])
def test_bad_constraints_are_400s_naming_the_param(server, body, param, words):
    payload = {"model": server.model, "messages": HELLO, "max_tokens": 5, **body}
    response = httpx.post(f"{server.base_url}/chat/completions", json=payload, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


@pytest.mark.parametrize("constraint", [{"choice": ["<tool_call>"]}, {"regex": "<tool_call>"}])
def test_a_constraint_forcing_an_added_tokens_text_is_a_400(client, server, constraint):
    """The text of an added token ("<tool_call>") as a forced constraint: llguidance
    offers the token and then refuses it, which had ended the request as a 500."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=server.model, messages=HELLO, max_tokens=8,
                                       extra_body={"structured_outputs": constraint})
    assert caught.value.code == "invalid_constraint" and "added token" in caught.value.message
    reply = client.chat.completions.create(model=server.model, messages=HELLO, max_tokens=4, seed=1)
    assert reply.choices[0].finish_reason in ("stop", "length")   # the engine serves on


def test_a_repair_the_grammar_refuses_is_not_made(server):
    """json-repair had made `{"n":""}` where the schema asks for an integer, and an array
    of a json_object reply; a repair is kept only where the request's grammar takes it."""
    from ruvllm_cli.engine.grammar import GrammarSpec
    from ruvllm_cli.engine.request import FinishReason
    from ruvllm_cli.server.bridge import Choice
    from ruvllm_cli.server.structured import repair_spec, repair_truncated_json

    schema = repair_spec(GrammarSpec.json_schema({
        "type": "object", "required": ["n", "s"], "additionalProperties": False,
        "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}))
    compiler = server.engine(lambda e: e.grammar_compiler)
    allowed = lambda text: compiler.accepts_text(schema, text)   # noqa: E731
    for cut, repaired in (('{"n":12', '{"n":12}'), ('{"s":"ab', '{"s":"ab"}'), ('{"n":', None)):
        choice = Choice(0, 0, text=cut, finish_reason=FinishReason.LENGTH)
        repair_truncated_json(choice, allowed=allowed)
        assert (choice.text, choice.repaired) == ((repaired, True) if repaired else (cut, False)), cut
    assert not compiler.accepts_text(GrammarSpec.json_object(), '["n"]')
    assert compiler.accepts_text(GrammarSpec.json_object(), '{"n":"x"}')
