"""Issue 18: values the validation admits must never kill the engine (they once made
the softmax NaN: a 500, then every later request failed until a restart)."""

from __future__ import annotations

import pytest
import httpx

POISON = [{"temperature": 1e-40}, {"temperature": 1e-300}, {"temperature": 5e-324}, {"top_p": 1e-300},
          {"repetition_penalty": 1e-300}, {"temperature": 1e-30, "top_p": 1e-300, "min_p": 1.0}]


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
@pytest.mark.parametrize("knobs", POISON, ids=lambda k: ",".join(f"{n}={v}" for n, v in k.items()))
def test_poisonous_sampling_values_answer_200_and_the_engine_lives(server, route, knobs):
    body = {"model": server.model, "max_tokens": 4, **knobs}
    body |= ({"messages": [{"role": "user", "content": "hi"}]} if route == "chat/completions" else {"prompt": "hi"})
    response = httpx.post(f"{server.base_url}/{route}", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def wider_tokenizer_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with two tokens added to its tokenizer beyond config.json's
    vocab_size (514 tokens, 512 logits), as models whose tokenizer grew after training."""
    import shutil

    from transformers import AutoTokenizer

    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.quantization import Quantization

    path = tmp_path_factory.mktemp("wider") / "model"
    shutil.copytree(tiny_model_dir, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<extra_a>", "<extra_b>"])
    tokenizer.save_pretrained(path)
    return load_model(path, "cpu", Quantization.F32)


@pytest.mark.parametrize("field", [{"logit_bias": {"513": 5}}, {"stop_token_ids": [513], "min_tokens": 2}],
                         ids=["logit_bias", "stop_token_ids"])
def test_an_id_the_tokenizer_has_but_the_model_not_is_a_400(wider_tokenizer_model, field):
    """It passed the check (against the tokenizer's 514), failed the batch's sampling
    step (512 logits) with a 500, and the engine, and so the server, with it."""
    from tests.server.conftest import build_server

    assert len(wider_tokenizer_model.tokenizer) == 514
    live = build_server(wider_tokenizer_model)
    try:
        body = {"model": live.model, "prompt": "hi", "max_tokens": 3, **field}
        response = httpx.post(f"{live.base_url}/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == next(iter(field)) and "[0, 512)" in error["message"]
        plain = httpx.post(f"{live.base_url}/completions", json={"model": live.model, "prompt": "hi", "max_tokens": 3},
                           timeout=30)
        assert plain.status_code == 200 and httpx.get(f"{live.url}/health", timeout=10).status_code == 200
    finally:
        live.stop()


def test_the_engine_refuses_such_ids_and_its_sampler_never_fails_a_batch_on_them(wider_tokenizer_model):
    import torch

    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.request import Request
    from ruvllm_cli.engine.sampler import apply_logit_bias, apply_min_tokens
    from ruvllm_cli.engine.sampling import SamplingParams
    from ruvllm_cli.errors import UsageError
    from ruvllm_cli.quantization import Quantization

    engine = LLMEngine(wider_tokenizer_model, EngineConfig(device="cpu", quantization=Quantization.F32,
                                                           max_num_seqs=2, max_model_len=128))
    for params in (SamplingParams(logit_bias={513: 1.0}), SamplingParams(stop_token_ids=[512])):
        with pytest.raises(UsageError, match=r"outside the vocabulary \[0, 512\)"):
            engine.add_request("hi", params)
    assert not engine.has_unfinished
    # Past the check (another caller of the sampler): the id is no logit, so nothing to do.
    request = Request(prompt_ids=[1, 2], params=SamplingParams(logit_bias={513: 1.0, 3: 2.0}, min_tokens=2))
    request.held_ids = (4, 700)
    logits = torch.zeros(1, 512)
    apply_logit_bias(logits, [request])
    apply_min_tokens(logits, [request])
    assert logits[0, 3] == 2.0 and logits[0, 4] == float("-inf") and int(torch.isfinite(logits).sum()) == 511
