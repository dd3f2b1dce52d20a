"""Families beyond the four our own classes compute, and the attention variants of
those four: the engine against transformers' eager forward, token for token.

Gemma (1, 2, 3) scale the embedding's rows by sqrt(hidden) inside the embedding
module, which the quantized tables replace; Gemma 2 caps the attention scores
(softcap); Gemma 2 and 3, Mistral v0.1, Phi-3 4k and Qwen2 with `use_sliding_window`
attend a sliding window of keys. Each is checked with prompts longer than the window,
prompts split into chunks (a chunk attends cached keys), requests batched and alone,
and the fused decode step where the family takes it."""

from __future__ import annotations

import random

import pytest
import torch

from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.engine import LLMEngine
from ruvllm_cli.engine.loader import load_model
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.quantization import Quantization
from ruvllm_cli.testing.device import TEST_DEVICE
from ruvllm_cli.testing.tiny_model import build_family_model

NEW_TOKENS = 12
WINDOW = 8
FAMILIES = {
    "gemma": {},
    "gemma2": {"sliding_window": WINDOW, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 24},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24},
    "qwen3": {},
    "mistral": {"sliding_window": WINDOW},
    "phi3": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
}
PROMPTS = [[random.Random(n).randrange(3, 500) for _ in range(n)] for n in (5, 13, 30)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = build_family_model(tmp_path_factory.mktemp(request.param), request.param,
                              **FAMILIES[request.param])
    return request.param, path


@pytest.fixture(scope="module")
def expected(family):
    """Transformers' greedy tokens on a device, each prompt alone (computed once per device)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens = {}

    def on(device: str) -> list[list[int]]:
        if device not in tokens:
            model = AutoModelForCausalLM.from_pretrained(family[1], dtype=torch.float32,
                                                         attn_implementation="eager").to(device).eval()
            with torch.inference_mode():
                tokens[device] = [model.generate(torch.tensor([p], device=device), generation_config=config)
                                  [0, len(p):].tolist() for p in PROMPTS]
        return tokens[device]
    return on


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in engine.generate(prompts, params)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "modules"])
def test_families_match_transformers(family, expected, fused):
    device = "cpu" if fused else TEST_DEVICE     # the fused step is a CPU's; the modules run on any device
    reference = expected(device)
    loaded = load_model(family[1], device, Quantization.F32, use_cache=False)
    together = LLMEngine(loaded, EngineConfig(device=device, quantization=Quantization.F32, fused_decode=fused))
    assert run(together, PROMPTS) == reference
    chunked = LLMEngine(loaded, EngineConfig(device=device, quantization=Quantization.F32, fused_decode=fused,
                                             max_num_batched_tokens=6))
    assert run(chunked, PROMPTS) == reference
    alone = LLMEngine(loaded, EngineConfig(device=device, quantization=Quantization.F32, fused_decode=fused))
    assert [run(alone, [p])[0] for p in PROMPTS] == reference


@pytest.mark.parametrize("quantization", [Quantization.F16, Quantization.Q8_0, Quantization.Q4_K_M])
def test_quantized_tables_keep_the_embedding_scale(tmp_path, quantization, monkeypatch):
    """Gemma's rows scaled by sqrt(hidden) = 8 under every table our quantizations put
    in its embedding's place, streamed, from the weight cache and through transformers."""
    path = build_family_model(tmp_path / "gemma", "gemma")
    monkeypatch.setenv("RUVLLM_WEIGHT_CACHE", "1")   # beside the model, in tmp_path
    ids = torch.tensor([[5, 17, 33]])
    rows = None
    caches = quantization is not Quantization.F16   # the weight cache holds q8 and q4k
    for streamed, cached in ((True, False), (True, caches), (False, False)):
        monkeypatch.setenv("RUVLLM_STREAM_LOAD", "1" if streamed else "0")
        loaded = load_model(path, "cpu", quantization, use_cache=streamed)
        assert loaded.from_weight_cache is cached and loaded.streamed is streamed
        embedding = loaded.model.get_input_embeddings()
        assert type(embedding).__name__ != "GemmaTextScaledWordEmbedding"
        looked_up = embedding(ids)
        bare = looked_up / 8.0
        if rows is None:
            rows = looked_up
            from transformers import AutoModelForCausalLM

            stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).get_input_embeddings()(ids)
            # the table's rounding (a few percent for int4), not a factor of 8, between ours and the stock rows
            assert (looked_up.float() - stock).norm() < 0.15 * stock.norm()
            assert (bare.float() - stock).norm() > 0.8 * stock.norm()
        assert torch.equal(looked_up, rows)


@pytest.mark.parametrize("quantization", [Quantization.Q8_0, Quantization.F16])
def test_fused_layer_loop_keeps_the_window(tmp_path, quantization):
    """The all-in-C decode step (our kernels' weights) attends the window as the
    modules do: the same tokens, past the window, with the C loop really taken."""
    path = build_family_model(tmp_path / "mistral", "mistral", sliding_window=WINDOW)
    loaded = load_model(path, "cpu", quantization, use_cache=False)
    fused = LLMEngine(loaded, EngineConfig(device="cpu", quantization=quantization))
    if fused.runner.fused is not None and fused.runner.fused.dtype == torch.bfloat16:
        # a CPU with AVX-512 BF16 loads f16 as bfloat16: the C loop and transformers' modules round
        # bfloat16 activations differently (seen on a lent machine's CPU: a near-tie flipped a token);
        # the loop's bits against its own Python loop are test_fused's
        pytest.skip("bfloat16 activations here: the modules round them differently")
    modules = LLMEngine(loaded, EngineConfig(device="cpu", quantization=quantization, fused_decode=False))
    assert fused.runner.fused is not None and fused.runner.fused.window == WINDOW
    assert run(fused, PROMPTS) == run(modules, PROMPTS)
    assert fused.runner.fused.c_steps > 0


def test_attention_sinks_are_refused_at_load(tmp_path):
    """gpt-oss's sinks are not computed: said when the model loads, not answered wrongly."""
    from ruvllm_cli.errors import ModelLoadError

    path = build_family_model(tmp_path / "oss", "gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                              layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    with pytest.raises(ModelLoadError, match="sinks"):
        load_model(path, "cpu", Quantization.F32, use_cache=False)
