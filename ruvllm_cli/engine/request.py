"""One request's state as it moves waiting -> running -> finished."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import TYPE_CHECKING

from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.errors import UsageError

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


class Priority(IntEnum):
    """Named levels of `RequestOptions.priority`; lower goes first (vLLM's rule), and
    any integer works too."""

    CRITICAL = -2
    HIGH = -1
    NORMAL = 0
    LOW = 1


def parse_priority(value: int | str | Priority) -> int:
    """An integer, or one of the named levels (any case)."""
    if isinstance(value, str):
        try:
            return int(Priority[value.strip().upper()])
        except KeyError:
            names = ", ".join(p.name.lower() for p in Priority)
            raise UsageError(f"priority {value!r} is not an integer or one of {names}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"priority must be an integer (got {value!r})")
    return int(value)


@dataclass(frozen=True)
class RequestOptions:
    """What a request carries beside its prompt and sampling: where its prefix-cache
    blocks may be shared, which LoRA adapter runs it, its scheduling priority, and
    who sent it (OpenAI's `user`, a `session_id`: logs and a scale-out router's key)."""

    cache_salt: str | None = None
    adapter: str | None = None
    priority: int | str | Priority = 0
    user: str | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "priority", parse_priority(self.priority))


@dataclass
class SwappedKV:
    """A preempted request's KV blocks copied to the swap pool: `blocks[i]` holds its
    device block i, for its first `num_computed_tokens` tokens."""

    blocks: list[int]
    num_computed_tokens: int


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
    priority: int = 0                                    # lower goes first (scheduling policy "priority")
    user: str | None = None
    session_id: str | None = None
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
    thinking: int | None = None                          # tokens in params.reasoning_block while it is open
    held_ids: tuple[int, ...] = ()                       # masked until params.min_tokens (EOS, stop ids)
    adapter_uid: int = 0                                 # LoRA adapter (LoRAAdapter.uid); 0 is the base model
    swappable: bool = True                               # False: its KV has a second pool (X-LoRA)
    swapped: SwappedKV | None = None                     # preempted by swapping, until resumed
    prompt_seen: "torch.Tensor | None" = None            # the prompt's distinct ids (repetition_penalty's)
    all_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_ids)

    @property
    def constrained(self) -> bool:
        """Its grammar masks this step's token (it has one, and no reasoning block is open)."""
        return self.grammar is not None and self.thinking is None

    @property
    def holds_ids(self) -> bool:
        """`held_ids` are still masked: fewer than `min_tokens` generated, a constraint
        waits for the reasoning block to end (the answer it constrains comes after it),
        or a constraint with `ignore_eos` can go on (a finished grammar ends the reply
        without a sampled EOS)."""
        return bool(self.held_ids) and (len(self.output_ids) < self.params.min_tokens
                                        or (self.grammar is not None and self.thinking is not None)
                                        or (self.grammar is not None and self.params.ignore_eos))

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
