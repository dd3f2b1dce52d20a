"""Drives the engine for a benchmark: exact prompts, exact generations, real stamps.

The runner steps the `LLMEngine` itself (no `EngineLoop` thread) so that the
requests of one iteration are all added before the first step: they really are
submitted together, and no thread hand-off sits inside the measured times.

Prompts are random token ids (a seeded `random.Random`) drawn from the tokenizer's
ordinary tokens, never a special or control token, fed as ids so their length is
exact. Every request of every iteration, warm-up included, gets fresh ids, so the
prefix cache (left on, as in chat and serve) finds nothing to reuse; the cached
token count of each request is still recorded and subtracted from prefill work.

With a grammar (`--json-schema`), every iteration runs the same workload twice in a
row, unconstrained and constrained, in alternating order, so drift in the machine's
speed hits both sides alike. A constrained request ends when its grammar completes (finish reason `stop`)
or at `gen_length` tokens: its figures are over the tokens it really produced.
"""

from __future__ import annotations

import random
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from ruvllm_cli.bench.metrics import IterationSample, RequestSample
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.errors import RuvllmError, UsageError

if TYPE_CHECKING:
    from ruvllm_cli.engine.grammar import GrammarSpec
    from ruvllm_cli.engine.sampling import SamplingParams

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
    structured: "GrammarSpec | None" = None   # also run each iteration constrained to it

    @property
    def sides(self) -> int:
        """Runs per iteration: unconstrained, and constrained when there is a grammar."""
        return 2 if self.structured is not None else 1

    @property
    def total_tokens(self) -> int:
        """Tokens the whole run generates at most, warm-up included (for a progress bar)."""
        return (self.warmup + self.iterations) * self.sides * self.concurrency * self.gen_length


@dataclass
class MaskTimer:
    """Time spent in the sampler's grammar-mask stage (fill each constrained row's
    bitmask, apply it to the logits) and the rows it masked, while `timing()` is on."""

    seconds: float = 0.0
    rows: int = 0

    @property
    def ms_per_token(self) -> float | None:
        return self.seconds * 1000.0 / self.rows if self.rows else None

    @contextmanager
    def timing(self) -> Iterator[None]:
        # `sample` looks `apply_grammar_masks` up in its module on every call, so a
        # wrapper installed there sees every mask stage without changing the sampler.
        from ruvllm_cli.engine import sampler

        original = sampler.apply_grammar_masks

        def timed(logits: Any, requests: Sequence[Any]) -> None:
            start = time.perf_counter()
            original(logits, requests)
            self.seconds += time.perf_counter() - start
            self.rows += sum(1 for request in requests if request.grammar is not None)

        sampler.apply_grammar_masks = timed
        try:
            yield
        finally:
            sampler.apply_grammar_masks = original


@dataclass(frozen=True)
class ConstrainedRun:
    """The constrained side of the measured iterations, and its mask-stage time."""

    iterations: tuple[IterationSample, ...]
    mask: MaskTimer


@dataclass(frozen=True)
class BenchRun:
    """What the runner measured: the measured iterations (warm-up left out)."""

    iterations: tuple[IterationSample, ...]
    preemptions: int
    constrained: ConstrainedRun | None = None   # with a grammar only


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

    def run(self, on_phase: Callable[[str, int], None] | None = None,
            on_done: Callable[[str, int, IterationSample], None] | None = None) -> BenchRun:
        """Warm-up iterations (discarded), then the measured ones.

        `on_phase("warmup"|"iteration", index)` is called as each one starts, and
        `on_done(phase, index, sample)` with its unconstrained sample as it ends."""
        announce = on_phase or (lambda phase, index: None)
        done = on_done or (lambda phase, index, sample: None)
        for index in range(1, self.settings.warmup + 1):
            announce("warmup", index)
            done("warmup", index, self.run_round(index)[0])
        preemptions_before = self.engine.stats.preemptions
        mask = MaskTimer()
        measured: list[IterationSample] = []
        constrained: list[IterationSample] = []
        for index in range(1, self.settings.iterations + 1):
            announce("iteration", index)
            plain, shaped = self.run_round(index, mask)
            done("iteration", index, plain)
            measured.append(plain)
            if shaped is not None:
                constrained.append(shaped)
        side = ConstrainedRun(tuple(constrained), mask) if self.settings.structured is not None else None
        return BenchRun(tuple(measured), self.engine.stats.preemptions - preemptions_before, side)

    def run_round(self, index: int, mask: MaskTimer | None = None
                  ) -> tuple[IterationSample, IterationSample | None]:
        """The unconstrained iteration and, with a grammar, the constrained one: in odd
        iterations unconstrained first, in even ones constrained first (A B, B A, ...),
        so neither side always runs second and a steady drift in speed cancels out."""
        if self.settings.structured is None:
            return self.run_iteration(index), None
        if index % 2:
            plain = self.run_iteration(index)
            return plain, self._timed_constrained(index, mask)
        shaped = self._timed_constrained(index, mask)
        return self.run_iteration(index), shaped

    def _timed_constrained(self, index: int, mask: MaskTimer | None) -> IterationSample:
        with mask.timing() if mask is not None else nullcontext():
            return self.run_constrained_iteration(index)

    def run_iteration(self, index: int) -> IterationSample:
        """Add `concurrency` fresh prompts, then step until every one has finished."""
        from ruvllm_cli.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=self.settings.gen_length, temperature=0.0, ignore_eos=True)
        finals = self._drive(params)
        return IterationSample(index, tuple(self._sample(output) for output in finals))

    def run_constrained_iteration(self, index: int) -> IterationSample:
        """Like `run_iteration`, each request constrained to the grammar (greedy; EOS only
        where the grammar allows it). A request that completes its grammar ends early."""
        from ruvllm_cli.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=self.settings.gen_length, temperature=0.0,
                                structured=self.settings.structured)
        finals = self._drive(params)
        samples = tuple(self._constrained_sample(output) for output in finals)
        # Requests that ended early leave the progress bar short of its total: catch up.
        self.on_tokens(sum(self.settings.gen_length - s.generated_tokens for s in samples))
        return IterationSample(index, samples)

    def _drive(self, params: "SamplingParams") -> list[Any]:
        """Add `concurrency` fresh prompts with `params`, step until every one has
        finished; their final outputs, in the order they were added."""
        prompts = random_prompts(self.pool, self.settings.concurrency, self.settings.prompt_length, self.rng)
        ids = [self.engine.add_request(prompt, params).request_id for prompt in prompts]
        finals: dict[str, Any] = {}
        while self.engine.has_unfinished:
            outputs = self.engine.step()
            self.on_tokens(sum(len(output.token_ids) for output in outputs))
            finals.update((o.request_id, o) for o in outputs if o.finished)
        return [finals[i] for i in ids]

    def _sample(self, output: Any) -> RequestSample:
        expected = self.settings.gen_length
        if output.finish_reason is not FinishReason.LENGTH or len(output.timings.token_times) != expected:
            raise _failed(output, f"after {len(output.timings.token_times)} of {expected} tokens")
        return _request_sample(output)

    def _constrained_sample(self, output: Any) -> RequestSample:
        if output.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) or not output.timings.token_times:
            raise _failed(output, f"after {len(output.timings.token_times)} tokens of a constrained run")
        return _request_sample(output)


def _failed(output: Any, when: str) -> RuvllmError:
    detail = f": {output.error}" if output.error else ""
    return RuvllmError(f"a benchmark request ended with {output.finish_reason.value} {when}{detail}")


def _request_sample(output: Any) -> RequestSample:
    timings = output.timings
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
