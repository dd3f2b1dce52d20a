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


def test_a_resumed_request_never_writes_into_a_block_the_prefix_cache_holds():
    """Scheduler alone, random traffic over three shared prompts under swap preemption:
    no chunk may write a position of a block that is full and cached (design section 2:
    full blocks are never written again). A request swapped out mid-block took, on its
    return, that block as a prefix hit once another request had filled it, then wrote
    the rest of it again under the requests reading it (22 such writes in 300 runs)."""
    import random

    from ruvllm_cli.engine.block_manager import BlockManager, SwapSpace
    from ruvllm_cli.engine.request import FinishReason, Request, RequestStatus
    from ruvllm_cli.engine.sampling import SamplingParams
    from ruvllm_cli.engine.scheduler import Scheduler, SchedulerConfig

    writes, resumed = [], 0
    for seed in range(200):
        rng = random.Random(seed)
        policy = rng.choice(["fcfs", "priority"])
        blocks = BlockManager(rng.randrange(8, 20), 16)
        clock = [0.0]
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=rng.choice([2, 3, 4]), policy=policy,
                                              max_num_batched_tokens=rng.choice([7, 16, 20, 33, 64]),
                                              preemption_mode="swap"), blocks, SwapSpace(100), clock=lambda: clock[0])
        prompts = [[rng.randrange(5, 50) for _ in range(rng.randrange(20, 90))] for _ in range(3)]
        added = 0
        for _ in range(400):
            clock[0] += 0.01
            if added < 8 and rng.random() < 0.2:
                request = Request(prompt_ids=list(rng.choice(prompts)),
                                  params=SamplingParams(max_tokens=rng.randrange(5, 60)),
                                  priority=rng.randrange(0, 3) if policy == "priority" else 0)
                request.timings.arrival = clock[0]
                scheduler.add(request)
                added += 1
            out = scheduler.schedule()
            resumed += len(out.swap_done)
            for chunk in out.chunks:
                table = chunk.request.block_table
                writes += [(seed, chunk.request.request_id, position)
                           for position in range(chunk.start, chunk.start + chunk.num_new_tokens)
                           if blocks.blocks[table[position // 16]].block_hash is not None]
            scheduler.swapped(out)
            scheduler.postprocess(out)
            for chunk in out.chunks:
                request = chunk.request
                if chunk.completes and request.status is RequestStatus.RUNNING:
                    request.append_token(rng.randrange(5, 50))
                    if len(request.output_ids) >= request.params.max_tokens or request.num_tokens >= 16 * 8:
                        scheduler.finish(request, FinishReason.LENGTH)
            blocks.check_integrity(scheduler.live_requests())
    assert resumed > 100 and writes == []
