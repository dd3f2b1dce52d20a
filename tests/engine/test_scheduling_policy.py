"""Scheduling policies without a model: admission order and victims under fcfs and
priority, aging, and preemption by swap (its block plan and its fallback)."""

from __future__ import annotations

import pytest

from ruvllm_cli.engine.block_manager import BlockManager, SwapSpace
from ruvllm_cli.engine.request import (FinishReason, Priority, Request, RequestOptions, RequestStatus,
                                      parse_priority)
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.engine.scheduler import Scheduler, SchedulerConfig
from ruvllm_cli.errors import UsageError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(n: int, start: int = 0, priority: int = 0, arrival: float = 1000.0) -> Request:
    request = Request(prompt_ids=list(range(start, start + n)), params=SamplingParams(), priority=priority)
    request.timings.arrival = arrival
    return request


def scheduler(policy="priority", *, seqs=4, budget=64, blocks=64, block_size=4, mode="recompute", swap=0,
              aging=0.1, clock=None) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, policy=policy, aging_rate=aging,
                             preemption_mode=mode)
    return Scheduler(config, BlockManager(blocks, block_size), SwapSpace(swap) if swap else None,
                     clock=clock or Clock())


def run_step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    s.swapped(plan)
    completing = [c.request for c in plan.chunks if c.completes]
    s.postprocess(plan)
    for request in completing:
        request.append_token(token)
    return plan


def two_prefilled(s: Scheduler) -> tuple[Request, Request]:
    """Two 7-token requests (2 blocks of 4 each), prefilled and one token further:
    the next token of each needs a third block."""
    a, b = make(7, 0), make(7, 100)
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)
    return a, b


def test_priority_admits_by_priority_then_arrival():
    s = scheduler(seqs=2)
    late_high = make(4, 100, priority=-1, arrival=1000.5)
    early_low = make(4, 200, priority=1, arrival=1000.0)
    early_high = make(4, 300, priority=-1, arrival=1000.1)
    for r in (early_low, late_high, early_high):
        s.add(r)
    plan = run_step(s)
    assert [c.request for c in plan.chunks] == [early_high, late_high]
    assert list(s.waiting) == [early_low]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    s = scheduler("fcfs", seqs=2)
    first, second, third = make(4, 0, priority=5), make(4, 100, priority=-5), make(4, 200, priority=-9)
    for r in (first, second, third):
        s.add(r)
    assert [c.request for c in run_step(s).chunks] == [first, second]


def test_priority_preempts_the_worst_running_request_for_blocks():
    # 6 blocks of 4: three 7-token prompts take 2 blocks each; the next token of each needs a third.
    s = scheduler(blocks=6, seqs=4)
    low_late = make(7, 0, priority=1, arrival=1000.2)
    low_early = make(7, 100, priority=1, arrival=1000.1)
    high = make(7, 200, priority=0, arrival=1000.3)
    for r in (low_late, low_early, high):
        s.add(r)
    run_step(s)
    run_step(s)              # position 7 fits in the second block
    plan = run_step(s)       # position 8 needs a third block each: the worst gives way
    assert plan.preempted[0] is low_late
    assert low_late.status is RequestStatus.WAITING and low_late.num_computed_tokens == 0
    assert s.preemptions[(1, "recompute")] >= 1 and (0, "recompute") not in s.preemptions


def test_preemptions_count_priorities_beyond_a_hundred_at_a_hundred():
    """/metrics labels them by priority, which a client picks: each new one had added a
    series for good (a helper's pass: 50 after five rounds of 12 requests)."""
    s = scheduler(blocks=6, seqs=4)
    low_late = make(7, 0, priority=123_456, arrival=1000.2)
    low_early = make(7, 100, priority=654_321, arrival=1000.1)
    high = make(7, 200, priority=-5_000, arrival=1000.3)
    for r in (low_late, low_early, high):
        s.add(r)
    for _ in range(3):
        run_step(s)
    assert set(s.preemptions) == {(100, "recompute")} and low_late.priority == 123_456


def test_fcfs_preempts_the_latest_admitted():
    s = scheduler("fcfs", blocks=4)
    a, b = make(7, 0, priority=9), make(7, 100, priority=-9)
    s.add(a)
    s.add(b)
    for _ in range(2):
        run_step(s)
    assert run_step(s).preempted == [b]


def test_a_waiting_request_of_higher_priority_preempts_a_worse_running_one():
    s = scheduler(seqs=1)
    low = make(4, 0, priority=1, arrival=1000.0)
    s.add(low)
    run_step(s)
    high = make(4, 100, priority=-1, arrival=1000.5)
    s.add(high)
    plan = run_step(s)
    assert [c.request for c in plan.chunks] == [high] and plan.preempted == [low]
    assert s.running == [high] and list(s.waiting) == [low]
    equal = make(4, 200, priority=-1, arrival=1000.6)   # not better than the running one: it waits
    earlier = make(4, 300, priority=-1, arrival=999.0)  # same level, earlier: not a level better either
    s.add(equal)
    s.add(earlier)
    assert run_step(s).preempted == []


def test_one_level_better_preempts_unless_the_running_one_has_aged_past_it():
    """high over normal never preempted: the margin was taken between aged priorities,
    and the running request, which arrived first, had always aged more."""
    clock = Clock()
    s = scheduler(seqs=1, clock=clock)
    normal = make(4, 0, priority=0, arrival=clock.now)
    s.add(normal)
    run_step(s)
    clock.now += 0.5
    high = make(4, 100, priority=-1, arrival=clock.now)
    s.add(high)
    assert run_step(s).preempted == [normal] and s.running == [high]
    s.finish(high, FinishReason.STOP)
    run_step(s)
    assert s.running == [normal]
    clock.now += 20.0   # normal has aged two levels: -2 against a fresh high's -1
    s.add(make(4, 200, priority=-1, arrival=clock.now))
    assert run_step(s).preempted == [] and s.running == [normal]


def test_aging_admits_a_starved_request_within_its_bound():
    """One slot and a stream of priority -1 requests that each arrive now: a priority 1
    request gains 0.5 levels per second and must get in once it has waited
    (1 - (-1)) / 0.5 = 4 s, with the tie broken by its earlier arrival."""
    clock = Clock()
    s = scheduler(seqs=1, aging=0.5, clock=clock)
    starved = make(2, 0, priority=1, arrival=clock.now)
    s.add(starved)
    admitted_at = None
    for step in range(100):
        clock.now += 0.1
        fresh = make(2, 1000 + step * 10, priority=-1, arrival=clock.now)
        s.add(fresh)
        plan = run_step(s)
        for r in list(s.running):
            if r.num_computed_tokens >= 2:
                s.finish(r, FinishReason.STOP)
        if any(c.request is starved for c in plan.chunks):
            admitted_at = clock.now - starved.timings.arrival
            break
    assert admitted_at is not None and admitted_at <= 4.0 + 0.1 + 1e-9


def test_swap_moves_the_victims_blocks_and_brings_them_back():
    s = scheduler("fcfs", blocks=4, mode="swap", swap=8)
    a, b = two_prefilled(s)
    b_blocks = list(b.block_table)
    plan = run_step(s)                       # b is preempted by swap: its 2 blocks go to swap 0, 1
    assert plan.preempted == [b]
    assert plan.swap_out == [(b_blocks[0], 0), (b_blocks[1], 1)]
    assert b.swapped is not None and b.swapped.blocks == [0, 1] and b.swapped.num_computed_tokens == 8
    assert s.swap.num_free_blocks == 6
    assert s.preemptions == {(0, "swap"): 1}
    s.finish(a, FinishReason.STOP)
    plan = run_step(s)                       # b resumes: copied back, not recomputed
    [chunk] = plan.chunks
    assert chunk.request is b and chunk.num_new_tokens == 1 and b.num_computed_tokens == 9   # 8 came back
    # Its first block was still in the prefix cache (a's growth evicted the tail one):
    # only the second comes back from the swap pool.
    assert b.block_table[0] == b_blocks[0]
    assert plan.swap_in == [(1, b.block_table[1])]
    assert s.swap.num_free_blocks == 8 and b.swapped is None


def test_a_full_swap_pool_falls_back_to_recompute():
    s = scheduler("fcfs", blocks=4, mode="swap", swap=1)   # one swap block: b needs two
    a, b = two_prefilled(s)
    plan = run_step(s)
    assert plan.preempted == [b] and plan.swap_out == [] and b.swapped is None
    assert s.preemptions == {(0, "recompute"): 1}


def test_priority_levels_by_name_and_number():
    assert RequestOptions(priority="high").priority == Priority.HIGH == -1
    assert RequestOptions(priority="Critical").priority == -2
    assert parse_priority(7) == 7
    with pytest.raises(UsageError, match="not an integer or one of critical, high, normal, low"):
        RequestOptions(priority="urgent")


def test_a_swapped_request_the_prefix_cache_fully_restores_copies_nothing_and_frees_its_swap_blocks():
    s = scheduler("fcfs", blocks=5, mode="swap", swap=8)
    a, b = two_prefilled(s)
    b_blocks = list(b.block_table)
    plan = run_step(s)          # a takes the free block; b has none left and is swapped out
    assert plan.preempted == [b] and len(plan.swap_out) == 2
    s.finish(a, FinishReason.STOP)
    plan = run_step(s)          # both of b's full blocks are still cached: nothing to copy back
    assert b.block_table[:2] == b_blocks and plan.swap_in == [] and plan.swap_done == [0, 1]
    assert s.swap.num_free_blocks == 8
    s.swap.check_integrity(s.live_requests())
