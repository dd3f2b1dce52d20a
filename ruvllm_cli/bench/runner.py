"""Drives the engine for a benchmark: exact prompts, exact generations, real stamps.

The runner steps the `LLMEngine` itself (no `EngineLoop` thread) so that the
requests of one iteration are all added before the first step: they really are
submitted together, and no thread hand-off sits inside the measured times.

Prompts are random token ids (a seeded `random.Random`) drawn from the tokenizer's
ordinary tokens, never a special or control token, fed as ids so their length is
exact. Every request of every iteration, warm-up included, gets fresh ids, so the
prefix cache (left on, as in chat and serve) finds nothing to reuse; the cached
token count of each request is still recorded and subtracted from prefill work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ruvllm_cli.bench.metrics import IterationSample, RequestSample
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.errors import RuvllmError, UsageError

# Called after every engine step with the number of tokens the step produced.
ProgressCallback = Callable[[int], None]


@dataclass(frozen=True)
class BenchSettings:
    warmup: int = 3
    iterations: int = 10
    prompt_length: int = 128
    gen_length: int = 64
    concurrency: int = 1
    seed: int = 0

    @property
    def total_tokens(self) -> int:
        """Tokens the whole run generates, warm-up included (for a progress bar)."""
        return (self.warmup + self.iterations) * self.concurrency * self.gen_length


@dataclass(frozen=True)
class BenchRun:
    """What the runner measured: the measured iterations (warm-up left out)."""

    iterations: tuple[IterationSample, ...]
    preemptions: int


def prompt_token_pool(tokenizer: Any, vocab_size: int) -> list[int]:
    """Ids of ordinary tokens: known to both tokenizer and model, none special."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(token, "special", False):
            special.add(int(token_id))
    pool = [i for i in range(min(len(tokenizer), vocab_size)) if i not in special]
    if not pool:
        raise RuvllmError("the tokenizer has no ordinary tokens to build a prompt from")
    return pool


def random_prompts(pool: Sequence[int], count: int, length: int, rng: random.Random) -> list[list[int]]:
    """`count` prompts of exactly `length` ids drawn from `pool`."""
    return [rng.choices(pool, k=length) for _ in range(count)]


def check_fits(settings: BenchSettings, max_model_len: int) -> None:
    """Prompt plus generation must fit the engine's context, or generation stops early."""
    total = settings.prompt_length + settings.gen_length
    if total > max_model_len:
        raise UsageError(
            f"--prompt-length + --gen-length is {total} tokens; the model's context is {max_model_len}",
            "use shorter lengths")


class BenchmarkRunner:
    """Runs warm-up and measured iterations on one engine."""

    def __init__(self, engine: Any, settings: BenchSettings, on_tokens: ProgressCallback | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.on_tokens = on_tokens or (lambda count: None)
        self.pool = prompt_token_pool(engine.tokenizer, int(engine.loaded.model.config.vocab_size))
        self.rng = random.Random(settings.seed)

    def run(self, on_phase: Callable[[str, int], None] | None = None) -> BenchRun:
        """Warm-up iterations (discarded), then the measured ones.

        `on_phase("warmup"|"iteration", index)` is called as each one starts."""
        announce = on_phase or (lambda phase, index: None)
        for index in range(1, self.settings.warmup + 1):
            announce("warmup", index)
            self.run_iteration(index)
        preemptions_before = self.engine.stats.preemptions
        measured = []
        for index in range(1, self.settings.iterations + 1):
            announce("iteration", index)
            measured.append(self.run_iteration(index))
        return BenchRun(tuple(measured), self.engine.stats.preemptions - preemptions_before)

    def run_iteration(self, index: int) -> IterationSample:
        """Add `concurrency` fresh prompts, then step until every one has finished."""
        from ruvllm_cli.engine.sampling import SamplingParams

        settings = self.settings
        params = SamplingParams(max_tokens=settings.gen_length, temperature=0.0, ignore_eos=True)
        prompts = random_prompts(self.pool, settings.concurrency, settings.prompt_length, self.rng)
        ids = [self.engine.add_request(prompt, params).request_id for prompt in prompts]
        finals: dict[str, Any] = {}
        while self.engine.has_unfinished:
            outputs = self.engine.step()
            self.on_tokens(sum(len(output.token_ids) for output in outputs))
            finals.update((o.request_id, o) for o in outputs if o.finished)
        return IterationSample(index, tuple(self._sample(finals[i]) for i in ids))

    def _sample(self, output: Any) -> RequestSample:
        timings = output.timings
        expected = self.settings.gen_length
        if output.finish_reason is not FinishReason.LENGTH or len(timings.token_times) != expected:
            detail = f": {output.error}" if output.error else ""
            raise RuvllmError(
                f"a benchmark request ended with {output.finish_reason.value} after "
                f"{len(timings.token_times)} of {expected} tokens{detail}")
        return RequestSample(
            prompt_tokens=output.num_prompt_tokens,
            cached_tokens=output.num_cached_tokens,
            arrival=timings.arrival,
            scheduled=timings.scheduled,
            first_token=timings.first_token,
            finished=timings.finished,
            token_times=tuple(timings.token_times),
            finish_reason=output.finish_reason.value,
        )
