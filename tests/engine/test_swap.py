"""Preemption by swap through the engine: the KV blocks copied out come back with the
same contents, greedy output stays token-identical to transformers' (float32), and
a full swap pool falls back to recompute."""

from __future__ import annotations

import pytest
import torch

from ruvllm_cli.engine.model_runner import kv_bytes_per_block

from tests.engine.test_engine import GREEDY as GREEDY_PARAMS, NEW_TOKENS, PROMPTS, run_all


@pytest.fixture(scope="module")
def expected(greedy_reference):
    return [greedy_reference(p, NEW_TOKENS) for p in PROMPTS]


def small_pool(make_engine, loaded, **options):
    per_block = kv_bytes_per_block(loaded.model.config, loaded.dtype, 16)
    return make_engine(kv_cache_memory=14 * per_block, preemption_mode="swap", **options), per_block


def test_swap_preemption_matches_generate_and_restores_each_block(make_engine, loaded, expected):
    engine, per_block = small_pool(make_engine, loaded, swap_space=64 * kv_bytes_per_block(
        loaded.model.config, loaded.dtype, 16))
    runner = engine.runner
    saved: dict[int, list[torch.Tensor]] = {}   # swap block -> the device block's keys and values, per layer
    restored: list[int] = []
    original = runner.swap

    def checked_swap(out, back):
        for device, swap in out:
            saved[swap] = [t[:, device * 16:(device + 1) * 16].clone() for t in runner.cache.keys + runner.cache.values]
        original(out, back)
        for swap, device in back:
            now = [t[:, device * 16:(device + 1) * 16] for t in runner.cache.keys + runner.cache.values]
            assert all(torch.equal(a, b) for a, b in zip(saved[swap], now)), f"swap block {swap} came back changed"
            restored.append(swap)

    runner.swap = checked_swap
    assert run_all(engine, PROMPTS) == expected
    assert engine.scheduler.preemptions[(0, "swap")] > 0 and restored
    engine.check_integrity()
    assert engine.swap_space.num_free_blocks == engine.swap_space.num_blocks


def test_an_exhausted_swap_pool_falls_back_to_recompute(make_engine, loaded, expected):
    one_block = kv_bytes_per_block(loaded.model.config, loaded.dtype, 16)
    engine, _ = small_pool(make_engine, loaded, swap_space=one_block)   # one swap block
    assert run_all(engine, PROMPTS) == expected
    modes = {mode for _, mode in engine.scheduler.preemptions}
    assert "recompute" in modes
    engine.check_integrity()


def test_priority_policy_with_preemption_matches_generate(make_engine, loaded, expected):
    per_block = kv_bytes_per_block(loaded.model.config, loaded.dtype, 16)
    for mode in ("recompute", "swap"):
        engine = make_engine(kv_cache_memory=14 * per_block, scheduling_policy="priority", preemption_mode=mode,
                             swap_space=64 * per_block)
        requests = [engine.add_request(p, GREEDY_PARAMS, priority=i % 3 - 1) for i, p in enumerate(PROMPTS)]
        results = {r.request_id: [] for r in requests}
        while engine.has_unfinished:
            for out in engine.step():
                results[out.request_id] += out.token_ids
            engine.check_integrity()
        assert [results[r.request_id] for r in requests] == expected, mode
        assert sum(engine.scheduler.preemptions.values()) > 0
