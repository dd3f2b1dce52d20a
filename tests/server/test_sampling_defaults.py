"""A model's recommended sampling (generation_config.json's temperature, top_p, top_k,
min_p, repetition_penalty) is what a request that leaves those out samples with, on
every route, as vLLM's `--generation-config auto`: the official clients over the socket,
the engine's SamplingParams recorded as they arrive. A request's own values win;
`--generation-config ignore` gives each API's own defaults (Ollama's 0.8 / 0.9 / 40)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import anthropic
import ollama
import openai
import pytest

from ruvllm_cli.cli.chat import recommended_sampling, resolve_settings
from ruvllm_cli.cli.serve import sampling_line
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.sampling import model_sampling_defaults
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.server.ollama_api.protocol import OLLAMA_SAMPLING
from ruvllm_cli.server.protocol import SamplingFields
from tests.server.conftest import build_server

pytestmark = pytest.mark.timeout(120)

RECOMMENDED = {"temperature": 0.6, "top_p": 0.85, "top_k": 12, "repetition_penalty": 1.1}
API = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
HELLO = [{"role": "user", "content": "Hello there"}]


def knobs(params) -> dict:
    return {name: getattr(params, name) for name in API}


@pytest.fixture
def recorded(server_model):
    """A server whose model recommends RECOMMENDED, the SamplingParams of each request
    its engine takes (in order), and a factory for one with other app options."""
    made = []

    def make(**options):
        model = dataclasses.replace(server_model, sampling_defaults=dict(RECOMMENDED))
        live = build_server(model, names=("rec",), **options)
        made.append(live)
        seen: list = []

        def record(engine):
            add = engine.add_request

            def add_request(prompt, params=None, *args, **kwargs):
                seen.append(params)
                return add(prompt, params, *args, **kwargs)

            engine.add_request = add_request

        live.engine(record)
        return live, seen

    yield make
    for live in made:
        live.stop()


# ---- the file -------------------------------------------------------------------------
def test_the_file_s_recommendations_are_read(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "min_p": 0.05, "bos_token_id": 1, "eos_token_id": [2, 3]}))
    assert model_sampling_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                                                 "repetition_penalty": 1.05}
    # transformers' own defaults written out are no recommendation (vLLM reads the file's
    # difference from them); values ruvllm cannot sample with are left out, said in the log
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0, "min_p": None}))
    assert model_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": 3.5, "top_p": "high", "top_k": True, "repetition_penalty": 1.2}))
    with caplog.at_level(logging.WARNING):
        assert model_sampling_defaults(tmp_path) == {"repetition_penalty": 1.2}
    assert "temperature 3.5 is outside" in caplog.text
    (tmp_path / "generation_config.json").write_text("{not json")
    assert model_sampling_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").unlink()
    assert model_sampling_defaults(tmp_path) == {}


def test_the_loader_reads_them_for_the_engine(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.3, "top_k": 7}))
    loaded = load_model(model, "cpu", Quantization.F32)
    assert loaded.sampling_defaults == {"temperature": 0.3, "top_k": 7}


GGUF_SAMPLING = {"general.sampling.temp": 0.6, "general.sampling.top_p": 0.95, "general.sampling.top_k": 20,
                 "general.sampling.min_p": 0.0, "general.sampling.penalty_repeat": 1.05,
                 "general.sampling.penalty_last_n": 64, "general.sampling.sequence": "penalties;top_k;top_p;temp"}


def test_a_gguf_file_s_sampling_keys_are_read(tiny_model_dir, tmp_path, caplog):
    """llama.cpp writes generation_config.json's fields as general.sampling.* (float32):
    each key written is a recommendation, even one at an API's default (min_p 0)."""
    from ruvllm_cli.engine.gguf_check import check_gguf
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    gguf = write_gguf(tiny_model_dir, tmp_path / "tiny-Q8_0.gguf", metadata=GGUF_SAMPLING)
    expected = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}
    assert model_sampling_defaults(gguf, check_gguf(gguf).metadata) == expected
    assert load_model(gguf, "cpu", Quantization.Q8_0).sampling_defaults == expected
    plain = write_gguf(tiny_model_dir, tmp_path / "plain-Q8_0.gguf")
    assert model_sampling_defaults(plain, check_gguf(plain).metadata) == {}
    odd = write_gguf(tiny_model_dir, tmp_path / "odd-Q8_0.gguf",
                     metadata={"general.sampling.temp": 9.0, "general.sampling.top_p": 0.5})
    with caplog.at_level(logging.WARNING):
        assert model_sampling_defaults(odd, check_gguf(odd).metadata) == {"top_p": 0.5}
    assert "temperature 9.0 is outside" in caplog.text


def test_info_shows_a_gguf_file_s_recommendation(ruvllm, cli_env, tiny_model_dir, tmp_path):
    from ruvllm_cli.testing.tiny_gguf import write_gguf

    gguf = write_gguf(tiny_model_dir, tmp_path / "tiny-Q8_0.gguf", metadata=GGUF_SAMPLING)
    data = json.loads(ruvllm("info", str(gguf), "--json").stdout)
    assert data["sampling_defaults"] == data["gguf"][0]["sampling_defaults"] == {
        "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}
    table = ruvllm("info", str(gguf), env={**cli_env, "COLUMNS": "200"})
    assert "temperature 0.6, top_p 0.95, top_k 20, min_p 0, repetition_penalty 1.05" in table.stdout


def test_a_request_s_own_values_win_field_by_field():
    fields = SamplingFields(temperature=0.2, top_p=None, top_k=None, min_p=None, repetition_penalty=None)
    assert fields.unset == {"top_p", "top_k", "min_p", "repetition_penalty"}
    assert (fields.top_p, fields.top_k) == (1.0, 0)   # the API's until a model's apply
    mine = dataclasses.replace(fields, default_max_tokens=9).with_defaults(RECOMMENDED)   # replace keeps `unset`
    assert knobs(mine.params(8, 0)) == {"temperature": 0.2, "top_p": 0.85, "top_k": 12, "min_p": 0.0,
                                        "repetition_penalty": 1.1}


# ---- over the socket --------------------------------------------------------------------
def test_every_route_samples_with_the_model_s_recommendation(recorded):
    live, seen = recorded()
    oa = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
    oa.chat.completions.create(model="rec", messages=HELLO, max_tokens=2, seed=1)
    oa.completions.create(model="rec", prompt="Hello", max_tokens=2, seed=1)
    response = oa.responses.create(model="rec", input="Hello", max_output_tokens=2)
    anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=60).messages.create(
        model="rec", max_tokens=2, messages=HELLO)
    ol = ollama.Client(host=live.url, timeout=60)
    ol.chat(model="rec", messages=HELLO, options={"num_predict": 2})
    ol.generate(model="rec", prompt="Hello", options={"num_predict": 2})
    expected = {**API, **RECOMMENDED}
    assert [knobs(params) for params in seen] == [expected] * 6
    # the Response says what it sampled with
    assert (response.temperature, response.top_p) == (0.6, 0.85)
    # Ollama's show lists them as its Modelfile parameters
    shown = ol.show("rec").parameters
    assert shown.splitlines() == ["temperature                    0.6", "top_p                          0.85",
                                  "top_k                          12", "repeat_penalty                 1.1"]
    assert sampling_line(live.thread.app).startswith("temperature 0.6, top_p 0.85, top_k 12, repetition_penalty 1.1 ")
    live.assert_clean()


def test_given_values_win_and_the_rest_stay_the_model_s(recorded):
    live, seen = recorded()
    oa = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)
    oa.chat.completions.create(model="rec", messages=HELLO, max_tokens=2, temperature=0.0,
                               extra_body={"top_k": -1})
    ollama.Client(host=live.url, timeout=60).chat(model="rec", messages=HELLO,
                                                  options={"num_predict": 2, "top_p": 0.5, "repeat_penalty": 1.0})
    assert knobs(seen[0]) == {**API, **RECOMMENDED, "temperature": 0.0, "top_k": 0}
    assert knobs(seen[1]) == {**API, **RECOMMENDED, "top_p": 0.5, "repetition_penalty": 1.0}
    live.assert_clean()


def test_unset_is_the_same_reply_as_the_recommendation_written_out(recorded):
    live, _ = recorded()
    oa = openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60)

    def reply(**fields):
        return oa.chat.completions.create(model="rec", messages=HELLO, max_tokens=16, seed=7,
                                          **fields).choices[0].message.content

    assert reply() == reply(temperature=0.6, top_p=0.85, extra_body={"top_k": 12, "repetition_penalty": 1.1})
    live.assert_clean()


def test_ignore_gives_each_api_its_own_defaults(recorded):
    live, seen = recorded(model_sampling=False)
    openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0, timeout=60).chat.completions.create(
        model="rec", messages=HELLO, max_tokens=2)
    ol = ollama.Client(host=live.url, timeout=60)
    ol.chat(model="rec", messages=HELLO, options={"num_predict": 2})
    assert knobs(seen[0]) == API
    assert knobs(seen[1]) == {**API, **OLLAMA_SAMPLING}
    assert ol.show("rec").parameters == ""
    assert sampling_line(live.thread.app) is None
    live.assert_clean()


# ---- chat -------------------------------------------------------------------------------
def test_chat_takes_them_for_a_model_outside_the_registry():
    class Opened:   # what recommended_sampling reads of an OpenedEngine
        located = type("Located", (), {"ref": type("Ref", (), {"kind": "local", "entry": None})()})()
        engine = type("Engine", (), {"sampling_defaults": dict(RECOMMENDED)})()

    settings = resolve_settings({"max_tokens": 64, "temperature": 0.9, "top_p": None, "seed": None},
                                recommended_sampling(Opened()))
    assert (settings.temperature, settings.top_p, settings.top_k, settings.repetition_penalty) == (0.9, 0.85, 12, 1.1)
