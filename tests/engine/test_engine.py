"""The engine against transformers' own generate(): token identity, batching, preemption,
chunked prefill, prefix caching, cancellation, seeds, stop conditions."""

from __future__ import annotations

import random

import pytest

from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.engine.model_runner import kv_bytes_per_block
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.errors import UsageError

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def prompts_of_lengths(lengths, vocab=500, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


PROMPTS = prompts_of_lengths([3, 9, 16, 17, 31, 48, 70, 130])


@pytest.fixture(scope="module")
def expected(greedy_reference):
    return [greedy_reference(p, NEW_TOKENS) for p in PROMPTS]


def run_all(engine, prompts, params=GREEDY, check=True):
    requests = [engine.add_request(p, params) for p in prompts]
    results = {r.request_id: [] for r in requests}
    while engine.has_unfinished:
        for out in engine.step():
            results[out.request_id] += out.token_ids
        if check:
            engine.check_integrity()
    return [results[r.request_id] for r in requests]


def test_together_matches_generate(make_engine, expected):
    engine = make_engine()
    assert run_all(engine, PROMPTS) == expected
    engine.block_manager.check_integrity([])


def test_chunked_prefill_matches_generate(make_engine, expected):
    engine = make_engine(max_num_batched_tokens=20)
    assert run_all(engine, PROMPTS) == expected
    assert engine.stats.steps > NEW_TOKENS + 130 // 20  # prompts really were split


def test_preemption_matches_generate(make_engine, loaded, expected):
    per_block = kv_bytes_per_block(loaded.model.config, loaded.dtype, 16)
    engine = make_engine(kv_cache_memory=14 * per_block)  # far less than 8 requests need
    assert engine.block_manager.num_blocks == 14
    assert run_all(engine, PROMPTS) == expected
    assert engine.stats.preemptions > 0


def test_a_pool_smaller_than_the_context_caps_the_context(make_engine, loaded):
    """--kv-cache-memory below one whole context: the context shrinks to the pool, so a
    request that could never fit is refused before it starts (it used to run until the
    pool ran out and fail there), and one that fits runs to its end."""
    per_block = kv_bytes_per_block(loaded.model.config, loaded.dtype, 16)
    engine = make_engine(kv_cache_memory=4 * per_block, max_model_len=256)
    assert engine.max_model_len == 64 and engine.context_before_kv_cap == 256
    with pytest.raises(UsageError, match="64"):
        engine.add_request(list(range(10, 80)), SamplingParams(max_tokens=4))
    request = engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=200, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    assert request.finish_reason is FinishReason.LENGTH and request.error is None
    assert len(request.output_ids) == 64 - 20
    assert make_engine(kv_cache_memory=64 * per_block, max_model_len=256).context_before_kv_cap is None


def test_a_pool_beyond_free_memory_is_refused(make_engine):
    import psutil

    with pytest.raises(UsageError, match="is more than the .* GiB free"):
        make_engine(kv_cache_memory=psutil.virtual_memory().total * 2, device="cpu")


def test_a_swap_pool_beyond_free_memory_is_refused(make_engine):
    import psutil

    with pytest.raises(UsageError, match="--swap-space .* GiB is more than the .* GiB of memory free"):
        make_engine(preemption_mode="swap", swap_space=psutil.virtual_memory().total * 2, device="cpu")


def test_one_after_another_matches_generate(make_engine, expected):
    engine = make_engine()
    assert [run_all(engine, [p])[0] for p in PROMPTS] == expected


def test_prefix_cache_on_and_off_give_identical_tokens(make_engine, expected):
    shared = prompts_of_lengths([64], seed=5)[0]
    prompts = [shared + p for p in PROMPTS]
    off = make_engine(enable_prefix_caching=False)
    on = make_engine()
    first = run_all(off, prompts)
    run_all(on, prompts[:1])                  # warms the cache with the shared prefix
    second = run_all(on, prompts[1:])
    assert [first[0]] + second == first
    assert on.block_manager.stats.hits >= 7 * 64


def test_batching_runs_far_fewer_steps_than_tokens(make_engine):
    engine = make_engine()
    run_all(engine, PROMPTS, check=False)
    total = len(PROMPTS) * NEW_TOKENS
    assert engine.stats.steps <= NEW_TOKENS + 2
    assert engine.stats.steps * 4 < total


def test_same_seed_same_sample_while_sharing_a_batch(make_engine):
    engine = make_engine()
    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    others = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    prompt = PROMPTS[4]
    requests = [engine.add_request(prompt, sampled), engine.add_request(PROMPTS[1], others),
                engine.add_request(prompt, sampled), engine.add_request(PROMPTS[6], others)]
    got = {r.request_id: [] for r in requests}
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id] += out.token_ids
    a, _, b, _ = (got[r.request_id] for r in requests)
    assert a == b and len(a) == 16
    alone = make_engine()
    assert run_all(alone, [prompt], sampled) == [a]   # and whatever else is in the batch


def test_cancel_frees_blocks_and_others_finish_unchanged(make_engine, expected):
    engine = make_engine()
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    got = {r.request_id: [] for r in requests}
    victim = requests[3]
    for _ in range(5):
        for out in engine.step():
            got[out.request_id] += out.token_ids
    final = engine.abort(victim.request_id)
    assert final.finished and final.finish_reason is FinishReason.CANCELLED
    assert victim.block_table == []
    engine.check_integrity()
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id] += out.token_ids
    for i, r in enumerate(requests):
        if r is not victim:
            assert got[r.request_id] == expected[i]
    engine.block_manager.check_integrity([])


def test_max_tokens_and_eos_finish_reasons(make_engine, loaded):
    engine = make_engine()
    eos = loaded.eos_token_ids[0]
    length = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert (len(length.token_ids), length.finish_reason) == (5, FinishReason.LENGTH)
    first = length.token_ids[0]
    stop = engine.generate([PROMPTS[2]], SamplingParams(max_tokens=5, temperature=0.0,
                                                        stop_token_ids=(first,)))[0]
    assert (stop.token_ids, stop.finish_reason) == ([first], FinishReason.STOP)
    assert eos in loaded.eos_token_ids


def test_stop_string_cuts_text_and_finishes(make_engine):
    engine = make_engine()
    free = engine.generate([PROMPTS[5]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    cut = engine.generate([PROMPTS[5]], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                       stop=(stop,)))[0]
    assert cut.finish_reason is FinishReason.STOP and cut.stop_string == stop
    assert cut.text == text[:text.find(stop)]
    assert free.stop_string is None


def test_logprobs_are_reported_with_alternatives(make_engine):
    engine = make_engine()
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3,
                                                       ignore_eos=True))[0]
    assert len(out.logprobs) == 4
    for tokid, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tokid and lp.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0][0] == tokid   # greedy picks the most likely


def test_bad_prompts_are_usage_errors(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(UsageError):
        engine.add_request([], GREEDY)
    with pytest.raises(UsageError):
        engine.add_request(list(range(3, 70)), GREEDY)
    with pytest.raises(UsageError):
        engine.add_request([10**7], GREEDY)
    with pytest.raises(UsageError):
        engine.add_request(["input_ids"], GREEDY)


def test_generation_stops_at_the_context_limit(make_engine):
    engine = make_engine(max_model_len=40)
    out = engine.generate([PROMPTS[4]], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason is FinishReason.LENGTH and len(PROMPTS[4]) + len(out.token_ids) == 40


def test_randomized_stress_keeps_integrity(make_engine, loaded):
    """Many overlapping prompts, cancellations and a tiny pool: integrity after every step."""
    rng = random.Random(7)
    per_block = kv_bytes_per_block(loaded.model.config, loaded.dtype, 16)
    engine = make_engine(kv_cache_memory=12 * per_block, max_num_batched_tokens=64, max_num_seqs=8)
    stems = prompts_of_lengths([40, 33, 20], seed=11)
    live = []
    for step in range(300):
        if rng.random() < 0.5:
            prompt = rng.choice(stems)[: rng.randrange(1, 40)] + prompts_of_lengths([rng.randrange(1, 30)],
                                                                                  seed=step)[0]
            params = SamplingParams(max_tokens=rng.randrange(1, 60), temperature=rng.choice([0.0, 0.8]),
                                    ignore_eos=True)
            live.append(engine.add_request(prompt, params, cache_salt=rng.choice([None, "t1"])).request_id)
        if live and rng.random() < 0.1:
            engine.abort(live.pop(rng.randrange(len(live))))
        finished = {o.request_id for o in engine.step() if o.finished}
        live = [r for r in live if r not in finished]
        engine.check_integrity()
    while engine.has_unfinished:
        engine.step()
        engine.check_integrity()
    engine.block_manager.check_integrity([])
    assert engine.stats.preemptions > 0 and engine.block_manager.stats.evictions > 0


def test_a_request_that_fails_to_sample_ends_alone(make_engine):
    def broken(ids, row):
        raise RuntimeError("boom")

    engine = make_engine()
    alone = make_engine().generate([PROMPTS[1]], GREEDY)[0].token_ids
    bad = SamplingParams(max_tokens=8, temperature=1.0, logits_processors=[broken])
    results = engine.generate([PROMPTS[0], PROMPTS[1]], [bad, GREEDY])
    assert results[0].finish_reason is FinishReason.ERROR and "boom" in results[0].error
    assert results[1].token_ids == alone and results[1].finish_reason is FinishReason.LENGTH
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.generate([PROMPTS[1]], GREEDY)[0].token_ids == alone


def test_a_forward_that_raises_fails_its_step_s_requests_not_the_engine(make_engine, expected, monkeypatch):
    """A request no check foresaw could make the model's forward raise (an X-LoRA whose
    classifier did not fit did): its step's requests end with the error, the engine
    goes on, and nothing the step wrote is reused by the prefix cache. A second
    failure in a row is the engine's."""
    engine = make_engine()
    poison = engine.add_request(PROMPTS[0], GREEDY)
    execute = engine.runner.execute
    calls = {"n": 0}

    def once_broken(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("selected index k out of range")
        return execute(chunks)

    monkeypatch.setattr(engine.runner, "execute", once_broken)
    [failed] = engine.step()
    assert failed.request_id == poison.request_id and failed.finish_reason is FinishReason.ERROR
    assert "selected index k out of range" in failed.error
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # the same prompt again, and the others: the tokens a clean engine gives
    assert run_all(engine, PROMPTS) == expected
    monkeypatch.setattr(engine.runner, "execute", lambda chunks: (_ for _ in ()).throw(RuntimeError("broken")))
    engine.add_request(PROMPTS[1], GREEDY)
    engine.step()   # the first failure: the request's
    engine.add_request(PROMPTS[2], GREEDY)
    with pytest.raises(RuntimeError, match="broken"):
        engine.step()   # the second in a row: the engine's


def test_a_forward_one_request_breaks_fails_that_request_alone(make_engine, expected, monkeypatch):
    """A step whose forward raises runs each of its requests again alone: only the one
    that fails alone ends (with the error); its step-mates go on to the tokens a clean
    engine gives, batched again from the next step."""
    engine = make_engine()
    requests = [engine.add_request(p, GREEDY) for p in PROMPTS]
    poison = requests[2]
    execute = engine.runner.execute
    sizes = []

    def breaks_on_poison(chunks):
        sizes.append(len(chunks))
        if any(chunk.request is poison for chunk in chunks):
            raise RuntimeError("selected index k out of range")
        return execute(chunks)

    monkeypatch.setattr(engine.runner, "execute", breaks_on_poison)
    tokens = {r.request_id: [] for r in requests}
    finished = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finished[out.request_id] = out
        engine.check_integrity()
    assert finished[poison.request_id].finish_reason is FinishReason.ERROR
    assert "selected index k out of range" in finished[poison.request_id].error
    assert [tokens[r.request_id] for r in requests if r is not poison] == \
        [e for r, e in zip(requests, expected) if r is not poison]
    assert all(finished[r.request_id].finish_reason is FinishReason.LENGTH for r in requests if r is not poison)
    assert max(sizes[sizes.index(1) + 1:]) > 1   # batched again after the reruns
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
