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

With LoRA adapters (`--lora`), the two sides are "base" (every request on the base
model) and "mixed" (the same requests spread round-robin over the base model and the
adapters), in the same alternating order.
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
    adapters: tuple[str, ...] = ()             # also run each iteration mixed over these LoRA adapters

    @property
    def sides(self) -> int:
        """Runs per iteration: the plain one, and the constrained or mixed one."""
        return 2 if self.structured is not None or self.adapters else 1

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
class AdapterUse:
    """One LoRA adapter of the mixed side: its rank and the measured requests it served."""

    name: str
    rank: int
    requests: int


@dataclass(frozen=True)
class MixedRun:
    """The mixed side of the measured iterations, and the adapters' slot loads (copies
    into a slot: first uses and swaps) in the warm-up and in the measured iterations."""

    iterations: tuple[IterationSample, ...]
    adapters: tuple[AdapterUse, ...]
    base_requests: int
    slot_loads_warmup: int
    slot_loads_measured: int


@dataclass(frozen=True)
class BenchRun:
    """What the runner measured: the measured iterations (warm-up left out)."""

    iterations: tuple[IterationSample, ...]
    preemptions: int
    constrained: ConstrainedRun | None = None   # with a grammar only
    mixed: MixedRun | None = None               # with LoRA adapters only


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


def adapter_mix(adapters: Sequence[str], count: int) -> list[str | None]:
    """The adapter of each of `count` requests: round-robin over the base model (None)
    and `adapters`, base first."""
    choices: list[str | None] = [None, *adapters]
    return [choices[i % len(choices)] for i in range(count)]


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
        `on_done(phase, index, sample)` with its plain (unconstrained, base) sample as it ends."""
        announce = on_phase or (lambda phase, index: None)
        done = on_done or (lambda phase, index, sample: None)
        loads = [self.engine.lora.loads]
        for index in range(1, self.settings.warmup + 1):
            announce("warmup", index)
            done("warmup", index, self.run_round(index)[0])
        preemptions_before = self.engine.stats.preemptions
        loads.append(self.engine.lora.loads)
        mask = MaskTimer()
        measured: list[IterationSample] = []
        others: list[IterationSample] = []
        for index in range(1, self.settings.iterations + 1):
            announce("iteration", index)
            plain, other = self.run_round(index, mask)
            done("iteration", index, plain)
            measured.append(plain)
            if other is not None:
                others.append(other)
        loads.append(self.engine.lora.loads)
        return BenchRun(tuple(measured), self.engine.stats.preemptions - preemptions_before,
                        **self._other_run(tuple(others), mask, loads))

    def _other_run(self, iterations: tuple[IterationSample, ...], mask: MaskTimer,
                     loads: list[int]) -> dict[str, Any]:
        """BenchRun's `constrained` or `mixed` field; `loads`: the slot loads at the
        start, after the warm-up and at the end."""
        if self.settings.structured is not None:
            return {"constrained": ConstrainedRun(iterations, mask)}
        if not self.settings.adapters:
            return {}
        mix = adapter_mix(self.settings.adapters, self.settings.concurrency)
        uses = tuple(AdapterUse(name, self.engine.adapter(name).rank, mix.count(name) * len(iterations))
                     for name in self.settings.adapters)
        return {"mixed": MixedRun(iterations, uses, mix.count(None) * len(iterations),
                                  loads[1] - loads[0], loads[2] - loads[1])}

    def run_round(self, index: int, mask: MaskTimer | None = None
                  ) -> tuple[IterationSample, IterationSample | None]:
        """The plain iteration and, with a grammar or adapters, the constrained or mixed
        one: in odd iterations the plain one first, in even ones the other (A B, B A,
        ...), so neither side always runs second and a steady drift in speed cancels out."""
        other = self._other_side(mask)
        if other is None:
            return self.run_iteration(index), None
        if index % 2:
            plain = self.run_iteration(index)
            return plain, other(index)
        first = other(index)
        return self.run_iteration(index), first

    def _other_side(self, mask: MaskTimer | None) -> Callable[[int], IterationSample] | None:
        if self.settings.structured is not None:
            return lambda index: self._timed_constrained(index, mask)
        return self.run_mixed_iteration if self.settings.adapters else None

    def _timed_constrained(self, index: int, mask: MaskTimer | None) -> IterationSample:
        with mask.timing() if mask is not None else nullcontext():
            return self.run_constrained_iteration(index)

    def run_iteration(self, index: int, adapters: Sequence[str | None] | None = None) -> IterationSample:
        """Add `concurrency` fresh prompts (request i on LoRA adapter `adapters[i]`; None:
        the base model), then step until every one has finished."""
        from ruvllm_cli.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=self.settings.gen_length, temperature=0.0, ignore_eos=True)
        finals = self._drive(params, adapters)
        return IterationSample(index, tuple(self._sample(output) for output in finals))

    def run_mixed_iteration(self, index: int) -> IterationSample:
        """`run_iteration` with the requests spread round-robin over the base model and
        the adapters (`adapter_mix`)."""
        return self.run_iteration(index, adapter_mix(self.settings.adapters, self.settings.concurrency))

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

    def _drive(self, params: "SamplingParams", adapters: Sequence[str | None] | None = None) -> list[Any]:
        """Add `concurrency` fresh prompts with `params` (and `adapters`, one per prompt),
        step until every one has finished; their final outputs, in the order they were added."""
        prompts = random_prompts(self.pool, self.settings.concurrency, self.settings.prompt_length, self.rng)
        adapters = adapters or [None] * len(prompts)
        ids = [self.engine.add_request(prompt, params, adapter=adapter).request_id
               for prompt, adapter in zip(prompts, adapters)]
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
