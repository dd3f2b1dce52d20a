"""What the engine hands back for a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from ruvllm_cli.engine.request import FinishReason, RequestTimings
from ruvllm_cli.engine.sampler import TokenLogprob


class RequestError(str):
    """A request's error text that is the request's own doing, not the engine's (the
    server answers it as a 400, not a 500): a str, so it travels where errors do."""


class AdapterGoneError(RequestError):
    """The request's LoRA adapter was unloaded after the name was checked and before
    the request reached the engine thread (the server answers 404, as for a name it
    never had)."""


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]                 # tokens generated in this step (usually one)
    text: str                            # text that became safe to show in this step
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    timings: RequestTimings | None = None
    error: str | None = None
    stop_string: str | None = None       # the stop string that ended it (vLLM's stop_reason); final only
    # Characters of text the reply has written so far, shown or not: a tail held back as a
    # possible stop string, and a stop string cut off, count (None: no text written)
    written: int | None = None


@dataclass
class EngineStats:
    steps: int = 0
    batched_tokens: int = 0              # all tokens through the model, summed over steps
    last_step_tokens: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
