"""LLMEngine: add requests, step them all through the model together, read outputs.

Synchronous and single-threaded by design; `EngineLoop` (loop.py) runs it in a
background thread for streaming callers (chat, serve, benchmark).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ruvllm_cli.engine.block_manager import BlockManager
from ruvllm_cli.engine.config import EngineConfig
from ruvllm_cli.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from ruvllm_cli.engine.loader import LoadedModel, load_model
from ruvllm_cli.engine.model_runner import ModelRunner, kv_bytes_per_block
from ruvllm_cli.engine.outputs import EngineStats, RequestOutput
from ruvllm_cli.engine.request import FinishReason, Request
from ruvllm_cli.engine.sampler import SamplingFailure, TokenLogprob, sample
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.engine.scheduler import Scheduler, SchedulerConfig
from ruvllm_cli.errors import UsageError


@dataclass
class _Stream:
    """Per-request text state: detokenizer plus stop-string matcher."""

    detokenizer: IncrementalDetokenizer
    matcher: StopMatcher
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig()) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or 4096, loaded.max_context)
        num_blocks = plan_num_blocks(loaded, config, self.max_model_len)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.token_budget(loaded.device.type)),
            self.block_manager)
        self.runner = ModelRunner(loaded.model, num_blocks, config.block_size, loaded.device, loaded.dtype)
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, _Stream] = {}
        self._vocab_size = int(loaded.model.config.vocab_size)

    @classmethod
    def from_path(cls, path: str, config: EngineConfig = EngineConfig()) -> "LLMEngine":
        return cls(load_model(path, config.device, config.quantization), config)

    # ---- requests ----------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None) -> Request:
        params = params or SamplingParams()
        prompt_ids = self.prepare_prompt(prompt)
        request = Request(prompt_ids=prompt_ids, params=params, cache_salt=cache_salt)
        if request_id is not None:
            request.request_id = request_id
        if request.request_id in self.requests:
            raise UsageError(f"request id {request.request_id} is already in use")
        if params.seed is not None:
            request.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        self._streams[request.request_id] = _Stream(
            IncrementalDetokenizer(self.tokenizer, prompt_ids), StopMatcher(params.stop))
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request

    def prepare_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Tokenize and validate a prompt (UsageError if bad). Reads only what never
        changes after start-up, so any thread may call it."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(prompt_ids)
        return prompt_ids

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise UsageError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise UsageError(f"the prompt has {len(prompt_ids)} tokens; the context limit is "
                             f"{self.max_model_len}, including the reply")
        if not all(isinstance(i, int) for i in prompt_ids):
            raise UsageError("prompt token ids must be integers")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self._vocab_size:
            raise UsageError(f"prompt token ids must be in [0, {self._vocab_size})")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request at any point; returns its final output (None if unknown)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, FinishReason.CANCELLED)
        return self._final(request, "")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass over every scheduled token, sample, emit."""
        plan = self.scheduler.schedule()
        outputs = [self._final(r, "") for r in plan.rejected]
        self.stats.preemptions = self.scheduler.num_preemptions
        if not plan.chunks:
            return outputs
        now = time.perf_counter()
        for chunk in plan.chunks:
            if chunk.request.timings.scheduled is None:
                chunk.request.timings.scheduled = now
        logits, sampled = self.runner.execute(plan.chunks)
        for chunk in plan.chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
            self.block_manager.cache_full_blocks(chunk.request)
        self.stats.steps += 1
        self.stats.last_step_tokens = plan.num_tokens
        self.stats.batched_tokens += plan.num_tokens
        if logits is not None:
            tokens, logprobs = sample(logits, sampled)
            outputs += [self._accept(r, t, lp) for r, t, lp in zip(sampled, tokens, logprobs)]
        return outputs

    def _accept(self, request: Request, token: int | SamplingFailure,
                logprob: TokenLogprob | None) -> RequestOutput:
        if isinstance(token, SamplingFailure):
            request.error = token.message
            self.scheduler.finish(request, FinishReason.ERROR)
            return self._final(request, "")
        now = time.perf_counter()
        if request.timings.first_token is None:
            request.timings.first_token = now
        request.timings.token_times.append(now)
        request.append_token(token)
        self.stats.generated_tokens += 1
        stream = self._streams[request.request_id]
        if logprob is not None:
            stream.logprobs.append(logprob)
        params = request.params
        is_eos = token in params.stop_token_ids or (
            not params.ignore_eos and token in self.loaded.eos_token_ids)
        text, hit_stop = ("", False) if is_eos else stream.matcher.feed(stream.detokenizer.add(token))
        reason = None
        if is_eos or hit_stop:
            reason = FinishReason.STOP
        elif len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is None:
            return self._output(request, [token], text, logprob)
        self.scheduler.finish(request, reason)
        if not hit_stop:
            # A reply may end inside a multi-byte character: show what there is.
            text += stream.matcher.feed(stream.detokenizer.flush())[0] + stream.matcher.flush()
        return self._final(request, text, [token], logprob)

    def _output(self, request: Request, tokens: list[int], text: str,
                logprob: TokenLogprob | None) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id, token_ids=tokens, text=text,
            logprobs=[logprob] if logprob is not None else [],
            num_prompt_tokens=request.num_prompt_tokens, num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_ids), timings=request.timings)

    def _final(self, request: Request, text: str, tokens: list[int] | None = None,
               logprob: TokenLogprob | None = None) -> RequestOutput:
        output = self._output(request, tokens or [], text, logprob)
        output.finished = True
        output.finish_reason = request.finish_reason.value if request.finish_reason else None
        output.error = request.error
        self.stats.prompt_tokens += request.num_prompt_tokens
        del self.requests[request.request_id]
        del self._streams[request.request_id]
        return output

    # ---- conveniences -------------------------------------------------------------
    def generate(self, prompts: Iterable[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list["Completion"]:
        """Run prompts to completion together; results in prompt order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        results = {r.request_id: Completion(r.request_id) for r in requests}
        while self.has_unfinished:
            for output in self.step():
                results[output.request_id].add(output)
        return [results[r.request_id] for r in requests]

    def live_requests(self) -> list[Request]:
        return self.scheduler.live_requests()

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.live_requests())


@dataclass
class Completion:
    """A finished request's accumulated outputs (for `LLMEngine.generate`)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None

    def add(self, output: RequestOutput) -> None:
        self.token_ids += output.token_ids
        self.text += output.text
        self.logprobs += output.logprobs
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reason, self.error = output.finish_reason, output.error


def plan_num_blocks(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> int:
    """KV blocks from the memory budget: --kv-cache-memory if given, else a share of
    free memory, capped by what max_num_seqs sequences of max_model_len can use."""
    per_block = kv_bytes_per_block(loaded.model.config, loaded.dtype, config.block_size)
    if config.kv_cache_memory is not None:
        return max(1, config.kv_cache_memory // per_block)
    if loaded.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(loaded.device)
        budget = int(free * 0.9)
    else:
        import psutil

        budget = int(psutil.virtual_memory().available * config.kv_cache_fraction)
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(budget // per_block, useful))
