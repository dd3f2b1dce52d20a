"""Decides, each step, which tokens of which requests go through the model.

One rule drives it: a scheduled request's `num_computed_tokens` catches up with its
tokens, within the step's token budget. Running requests go first (decodes, and the
rest of chunked prompts); then waiting requests are admitted while budget, blocks
and `max_num_seqs` allow. When a running request needs a block and none is free,
one request is preempted: its blocks are freed (they stay in the prefix cache) and
it waits again, to be recomputed later, or with `preemption_mode="swap"` to have its
blocks copied back from the swap pool (recompute when the pool is full).

Policies: `fcfs` admits in arrival order and preempts the most recently admitted
request. `priority` orders both by (effective priority, arrival), lower first, where
a request's effective priority improves by `aging_rate` levels per second since its
arrival (so no request starves), preempts the worst running request, and lets a
waiting request preempt a running one at least a level worse to get in.

With LoRA adapters, a waiting request whose adapter would make more distinct
adapters run than there are slots (`max_loras`) waits, and the ones behind it may go
first.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from ruvllm_cli.engine.block_manager import BlockManager, SwapSpace
from ruvllm_cli.engine.request import FinishReason, Request, RequestStatus, SwappedKV

POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
# Levels a waiting or running request gains per second since it arrived, under the
# priority policy: a request 10 levels below the traffic ahead of it is served like
# that traffic after 100 s.
DEFAULT_AGING_RATE = 0.1
# A waiting request preempts a running one only if it ranks this many levels better:
# without the margin, requests of one priority that arrived a moment apart took each
# other's places step after step (each time recomputing the one thrown out).
PREEMPT_MARGIN = 1.0
# /metrics counts preemptions by priority; a client picks any integer, so beyond this
# they count at +-100 (a label set of at most 201 x 2, where each new priority had added
# a series for good: a helper's pass).
PRIORITY_LABELS = 100


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    max_loras: int = 0          # distinct LoRA adapters running at once (the slots)
    policy: str = "fcfs"
    aging_rate: float = DEFAULT_AGING_RATE
    preemption_mode: str = "recompute"


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
    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, swap block), before the step
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (swap block, device block), after swap_out
    swap_done: list[int] = field(default_factory=list)              # swap blocks free once the copies ran

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, swap: SwapSpace | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        assert config.policy in POLICIES and config.preemption_mode in PREEMPTION_MODES
        self.config = config
        self.blocks = block_manager
        self.swap = swap
        self.clock = clock      # the timebase of RequestTimings.arrival
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # (priority within +-PRIORITY_LABELS, "recompute"|"swap") -> count
        self.preemptions: Counter[tuple[int, str]] = Counter()

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
        if self.config.policy == "priority":
            now = self.clock()
            self.running.sort(key=lambda r: self.rank(r, now))
            self.waiting = deque(sorted(self.waiting, key=lambda r: self.rank(r, now)))
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def rank(self, request: Request, now: float) -> tuple[float, float]:
        """(effective priority, arrival): lower is served first."""
        arrival = request.timings.arrival
        return request.priority - self.config.aging_rate * max(0.0, now - arrival), arrival

    # ---- running requests ----
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.blocks.grow(request, request.num_computed_tokens + num_new):
                victim = self.running[-1]   # the latest admitted, or under "priority" the worst
                self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
            index += 1
        return budget

    def _preempt(self, request: Request, out: SchedulerOutput, front: bool = True) -> int:
        """Take `request` out of the batch (its swap-out planned where the mode and the
        pool allow); returns the tokens of its chunk this step, if it had one."""
        released = 0
        for chunk in [c for c in out.chunks if c.request is request]:
            out.chunks.remove(chunk)
            released += chunk.num_new_tokens
        mode = "swap" if self._swap_out(request, out) else "recompute"
        self.running.remove(request)
        self.blocks.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions[(max(-PRIORITY_LABELS, min(PRIORITY_LABELS, request.priority)), mode)] += 1
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        out.preempted.append(request)
        return released

    def _swap_out(self, request: Request, out: SchedulerOutput) -> bool:
        if self.config.preemption_mode != "swap" or self.swap is None or not request.swappable:
            return False
        count = self.blocks.blocks_needed(request.num_computed_tokens)
        blocks = self.swap.allocate(count) if count else None
        if blocks is None:
            return False   # an empty request, or the pool is full: recompute
        out.swap_out += zip(request.block_table[:count], blocks)
        request.swapped = SwappedKV(blocks, request.num_computed_tokens)
        return True

    # ---- waiting requests ----
    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        held: list[Request] = []   # waiting for an adapter slot: keep their place in the queue
        adapters = {r.adapter_uid for r in self.running if r.adapter_uid}
        while self.waiting and budget > 0:
            request = self.waiting[0]
            uid = request.adapter_uid
            if uid and uid not in adapters and len(adapters) >= self.config.max_loras:
                held.append(self.waiting.popleft())
                continue
            if len(self.running) >= self.config.max_num_seqs or not self._try_admit(request, out, budget):
                if self._make_room(request, out):
                    budget = self.config.max_num_batched_tokens - out.num_tokens
                    continue
                if request.status is RequestStatus.FINISHED:   # rejected: it can never fit
                    continue
                break
            budget -= out.chunks[-1].num_new_tokens
            if uid:
                adapters.add(uid)
        self.waiting.extendleft(reversed(held))

    def _try_admit(self, request: Request, out: SchedulerOutput, budget: int) -> bool:
        """Admit `request` with a chunk of this step if its blocks fit; False (no change) if not."""
        hits = self.blocks.match_prefix(request.all_token_ids, request.prefix_salt)
        swapped = request.swapped
        if swapped is not None:
            # Only the blocks it had filled: a partial last block that another request
            # has since filled and cached is copied back, not taken, or the request's
            # next chunk rewrites the rest of it under the requests that share it.
            hits = hits[:swapped.num_computed_tokens // self.blocks.block_size]
        num_cached = len(hits) * self.blocks.block_size
        start = swapped.num_computed_tokens if swapped is not None else num_cached
        num_new = min(request.num_tokens - start, budget)
        needed = self.blocks.blocks_needed(start + num_new) - len(hits)
        if not self.blocks.can_allocate(needed + self._reclaimable(hits)):
            if not self.running and not out.chunks:
                self._reject_too_long(request, out)
            return False
        self.waiting.popleft()
        self._admit(request, hits, num_cached)
        assert self.blocks.grow(request, start + num_new)
        if swapped is not None:
            self._swap_in(request, len(hits), out)
        out.chunks.append(ScheduledChunk(request, num_new))
        return True

    def _swap_in(self, request: Request, num_hits: int, out: SchedulerOutput) -> None:
        """Copy back the swapped blocks the prefix cache no longer had."""
        swapped = request.swapped
        assert swapped is not None
        out.swap_in += [(swapped.blocks[i], request.block_table[i]) for i in range(num_hits, len(swapped.blocks))]
        out.swap_done += swapped.blocks
        request.num_computed_tokens = swapped.num_computed_tokens
        request.swapped = None

    def _make_room(self, request: Request, out: SchedulerOutput) -> bool:
        """Under "priority": preempt the worst running request if its priority is at
        least PREEMPT_MARGIN worse than `request`'s and, aged, still worse. The margin
        is between the priorities as given: between the aged ones, the running request,
        which arrived first and so had aged more, was never a full level behind, and a
        request one level better (high over normal) never preempted."""
        if self.config.policy != "priority" or not self.running or request.status is RequestStatus.FINISHED:
            return False
        now = self.clock()
        victim = max(self.running, key=lambda r: self.rank(r, now))
        if victim.priority - request.priority < PREEMPT_MARGIN \
                or self.rank(victim, now)[0] <= self.rank(request, now)[0]:
            return False
        self._preempt(victim, out, front=False)
        return True

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
        self._release_swap(request)
        request.finish(FinishReason.ERROR)
        out.rejected.append(request)

    def swapped(self, out: SchedulerOutput) -> None:
        """After the runner copied `out`'s swap-outs and swap-ins (before the step's
        forward, every step that has any): the blocks copied back are free."""
        if self.swap is not None:
            self.swap.release(out.swap_done)

    def postprocess(self, out: SchedulerOutput) -> None:
        """After the step ran: every scheduled chunk's KV is now in the cache, and its
        full blocks join the prefix cache."""
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
        self._release_swap(request)
        if not request.is_finished:
            request.finish(reason)

    def _release_swap(self, request: Request) -> None:
        if request.swapped is not None and self.swap is not None:
            self.swap.release(request.swapped.blocks)
        request.swapped = None
