"""Scheduling decisions without a model: budgets, chunking, admission, preemption."""

from ruvllm_cli.engine.block_manager import BlockManager
from ruvllm_cli.engine.request import FinishReason, Request, RequestStatus
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.engine.scheduler import Scheduler, SchedulerConfig


def make(n, start=0):
    return Request(prompt_ids=list(range(start, start + n)), params=SamplingParams())


def run_step(scheduler: Scheduler, sample_token: int = 7):
    """Apply a plan as the engine would (minus the model)."""
    plan = scheduler.schedule()
    completing = [chunk.request for chunk in plan.chunks if chunk.completes]
    scheduler.postprocess(plan)
    for request in completing:
        request.append_token(sample_token)
    return plan


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), BlockManager(32, 4))
    r = make(40)
    s.add(r)
    sizes = [[c.num_new_tokens for c in run_step(s).chunks] for _ in range(4)]
    assert sizes == [[16], [16], [8], [1]]
    assert r.output_ids == [7, 7]


def test_decodes_go_first_and_new_requests_join_the_next_step():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(64, 4))
    a = make(10)
    s.add(a)
    run_step(s)
    b = make(6, start=100)
    s.add(b)
    plan = run_step(s)
    assert [(c.request, c.num_new_tokens) for c in plan.chunks] == [(a, 1), (b, 6)]


def test_max_num_seqs_bounds_running():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), BlockManager(64, 4))
    reqs = [make(5, start=10 * i) for i in range(3)]
    for r in reqs:
        s.add(r)
    run_step(s)
    assert s.running == reqs[:2] and list(s.waiting) == reqs[2:]


def test_preemption_frees_the_newest_and_requeues_it_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    a, b = make(7), make(7, start=100)       # 2 blocks each: the pool is full
    s.add(a)
    s.add(b)
    run_step(s)                              # both prefilled: 7 computed, 8 tokens each
    run_step(s)                              # position 7 still fits in block 2 of 2
    plan = run_step(s)                       # position 8 needs a 3rd block: b is preempted
    assert plan.preempted == [b]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and s.running == [a]
    bm.check_integrity(s.live_requests())


def test_a_request_larger_than_the_pool_is_rejected_not_hung():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(2, 4))
    r = make(20)
    s.add(r)
    plan = s.schedule()
    assert plan.rejected == [r] and r.finish_reason is FinishReason.ERROR
    assert not s.has_work
