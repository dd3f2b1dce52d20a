"""Decides, each step, which tokens of which requests go through the model.

One rule drives it: a scheduled request's `num_computed_tokens` catches up with its
tokens, within the step's token budget. Running requests go first (decodes, and the
rest of chunked prompts); then waiting requests are admitted in arrival order while
budget, blocks and `max_num_seqs` allow. When a running request needs a block and
none is free, the most recently admitted request is preempted: its blocks are freed
(they stay in the prefix cache) and it goes back to the front of the queue, to be
recomputed later. With LoRA adapters, a waiting request whose adapter would make
more distinct adapters run than there are slots (`max_loras`) waits, and the ones
behind it may go first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ruvllm_cli.engine.block_manager import BlockManager
from ruvllm_cli.engine.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    max_loras: int = 0          # distinct LoRA adapters running at once (the slots)


@dataclass
class ScheduledChunk:
    request: Request
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def completes(self) -> bool:
        """After this chunk every token of the request is computed: sample the next one."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live_requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.blocks.grow(request, request.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.blocks.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        held: list[Request] = []   # waiting for an adapter slot: keep their place in the queue
        adapters = {r.adapter_uid for r in self.running if r.adapter_uid}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            uid = request.adapter_uid
            if uid and uid not in adapters and len(adapters) >= self.config.max_loras:
                held.append(self.waiting.popleft())
                continue
            hits = self.blocks.match_prefix(request.all_token_ids, request.prefix_salt)
            num_cached = len(hits) * self.blocks.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            needed = self.blocks.blocks_needed(num_cached + num_new) - len(hits)
            if not self.blocks.can_allocate(needed + self._reclaimable(hits)):
                if not self.running and not out.chunks:
                    self._reject_too_long(request, out)
                    continue
                break
            self.waiting.popleft()
            self._admit(request, hits, num_cached)
            assert self.blocks.grow(request, num_cached + num_new)
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
            if uid:
                adapters.add(uid)
        self.waiting.extendleft(reversed(held))

    def _reclaimable(self, hits: list[int]) -> int:
        """Hit blocks that sit in the free queue: taking them shrinks it."""
        return sum(1 for b in hits if self.blocks.blocks[b].ref_count == 0)

    def _admit(self, request: Request, hits: list[int], num_cached: int) -> None:
        self.blocks.allocate_prefix(request, hits)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
            self.blocks.record_lookup(request.num_prompt_tokens, num_cached)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _reject_too_long(self, request: Request, out: SchedulerOutput) -> None:
        # Nothing else holds blocks, and it still does not fit: it never will.
        self.waiting.popleft()
        request.error = (f"request needs {self.blocks.blocks_needed(request.num_tokens)} KV blocks, "
                         f"the cache has {self.blocks.num_blocks}")
        request.finish(FinishReason.ERROR)
        out.rejected.append(request)

    def postprocess(self, out: SchedulerOutput) -> None:
        """After the step ran: every scheduled chunk's KV is now in the cache, and
        its full blocks join the prefix cache."""
        for chunk in out.chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
            self.blocks.cache_full_blocks(chunk.request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Take a request out of the queues and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request)
        if not request.is_finished:
            request.finish(reason)
