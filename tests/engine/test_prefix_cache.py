"""Automatic prefix caching through the engine: reuse across turns and requests,
identical tokens with the cache on and off, salts, and what gets reported."""

from __future__ import annotations

import random

from ruvllm_cli.engine.chat_template import render_chat
from ruvllm_cli.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_shuffled_and_concurrent_runs_match_the_cache_off(make_engine):
    shared = tokens(80, 1)
    prompts = [shared + tokens(5 + 7 * i, 100 + i) for i in range(6)] + [tokens(40, 9)]
    reference = make_engine(enable_prefix_caching=False).generate(prompts, GREEDY)
    engine = make_engine()
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    one_by_one = {i: engine.generate([prompts[i]], GREEDY)[0] for i in order}
    together = engine.generate(prompts, GREEDY)       # now mostly cache hits, all at once
    for i, ref in enumerate(reference):
        assert one_by_one[i].token_ids == ref.token_ids
        assert together[i].token_ids == ref.token_ids
    assert all(c.num_cached_tokens >= 80 - 16 for c in together[:6])
    assert engine.block_manager.stats.hit_rate > 0.3


def test_second_turn_reuses_the_first_turn_kv(make_engine, loaded):
    engine = make_engine()
    tok = loaded.tokenizer
    messages = [{"role": "system", "content": "You are a terse assistant. " * 6},
                {"role": "user", "content": "Tell me about the weather in the mountains today."}]
    first_ids = render_chat(tok, messages)
    first = engine.generate([first_ids], SamplingParams(max_tokens=20, temperature=0.0))[0]
    messages += [{"role": "assistant", "content": first.text},
                 {"role": "user", "content": "And tomorrow?"}]
    second_ids = render_chat(tok, messages)
    second = engine.generate([second_ids], SamplingParams(max_tokens=4, temperature=0.0))[0]
    # Every full block of the first turn's prompt is served from the cache.
    assert second.num_cached_tokens >= len(first_ids) // 16 * 16
    assert second.num_prompt_tokens == len(second_ids)


def test_cache_salt_separates_tenants(make_engine):
    engine = make_engine()
    prompt = tokens(70, 4)
    engine.add_request(prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_unfinished:
        engine.step()
    other = engine.add_request(prompt, GREEDY, cache_salt="tenant-b")
    same = engine.add_request(prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_unfinished:
        engine.step()
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 64


def test_cache_off_reports_no_hits(make_engine):
    engine = make_engine(enable_prefix_caching=False)
    prompt = tokens(70, 5)
    engine.generate([prompt, prompt], GREEDY)
    out = engine.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and engine.block_manager.num_cached_blocks == 0


def test_a_float16_cache_gives_the_same_tokens_with_the_prefix_cache_and_in_chunks(tmp_path_factory):
    """q8 runs float32 activations over a float16 KV cache. A prompt's first chunk had
    attended its own keys unrounded, every later chunk and a prefix-cache hit read them
    rounded: the tokens changed with the prefix cache on or off (2 of 12 prompts on this
    model) and with the chunk budget (5 of 12)."""
    import torch

    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.quantization import Quantization
    from ruvllm_cli.testing.tiny_model import cached_tiny_model

    model = cached_tiny_model(tmp_path_factory.mktemp("wider"), hidden_size=256, intermediate_size=512,
                              num_layers=4, vocab_size=1024)
    loaded = load_model(model, "cpu", Quantization.Q8_0, use_cache=False)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    rng = random.Random(1234)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (70, 17, 33, 48, 16, 64, 9, 25, 40, 31, 55, 12)]

    def engine(**options):
        return LLMEngine(loaded, EngineConfig(device="cpu", quantization=Quantization.Q8_0,
                                              kv_cache_memory=64 << 20, **options))

    assert engine().runner.kv_dtype == torch.float16
    plain, chunked, cached = engine(enable_prefix_caching=False), engine(enable_prefix_caching=False,
                                                                         max_num_batched_tokens=8), engine()
    for prompt in prompts:
        whole = plain.generate([prompt], greedy)[0].token_ids
        assert chunked.generate([prompt], greedy)[0].token_ids == whole
        cached.generate([prompt], greedy)
        again = cached.generate([prompt], greedy)[0]
        assert again.token_ids == whole and again.num_cached_tokens == 16 * ((len(prompt) - 1) // 16)
