"""One request's state as it moves waiting -> running -> finished."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from ruvllm_cli.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from ruvllm_cli.engine.detokenizer import IncrementalDetokenizer, StopMatcher
    from ruvllm_cli.engine.grammar import GrammarMatcher


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(Enum):
    """Why a request ended; callers compare members, `.value` is for display."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class RequestTimings:
    """Wall-clock timestamps (time.perf_counter) of a request's life."""

    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """Prompt ids, sampling parameters, generated ids, block table and progress.

    `num_computed_tokens` counts the tokens whose KV is in the cache; each step lets
    it catch up with `all_token_ids`, which covers chunked prefill, prefix hits and
    recompute after preemption in one rule.
    """

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    # Per-sequence state the engine attaches when it adds the request:
    generator: "torch.Generator | None" = None           # when the request has a seed
    detokenizer: "IncrementalDetokenizer | None" = None  # token ids -> text deltas
    stop_matcher: "StopMatcher | None" = None            # stop strings on that text
    grammar: "GrammarMatcher | None" = None              # constrained decoding, when asked for
    adapter_uid: int = 0                                 # LoRA adapter (LoRAAdapter.uid); 0 is the base model
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_ids)

    @property
    def prefix_salt(self) -> object:
        """What keeps its prefix-cache blocks apart: the cache salt and the adapter
        (the same prompt under two adapters has different keys and values)."""
        return (self.cache_salt, self.adapter_uid) if self.adapter_uid else self.cache_salt

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.timings.finished = time.perf_counter()
