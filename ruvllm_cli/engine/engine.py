"""LLMEngine: add requests, step them all through the model together, read outputs.

Synchronous and single-threaded by design; `EngineLoop` (loop.py) runs it in a
background thread for streaming callers (chat, serve, benchmark).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ruvllm_cli.engine.block_manager import BlockManager, SwapSpace
from ruvllm_cli.engine.config import DEFAULT_CONTEXT, EngineConfig
from ruvllm_cli.engine.grammar import CompiledGrammar, GrammarCompiler
from ruvllm_cli.engine.loader import LoadedModel, free_memory, load_model
from ruvllm_cli.engine.lora import AdapterInUseError, AdapterNotFoundError, LoRAManager, read_adapter
from ruvllm_cli.engine.model_runner import ModelRunner, kv_bytes_per_block, kv_cache_dtype
from ruvllm_cli.engine.output_processor import OutputProcessor
from ruvllm_cli.engine.outputs import EngineStats, RequestOutput
from ruvllm_cli.engine.request import FinishReason, Request, RequestOptions
from ruvllm_cli.engine.sampler import SamplingFailure, TokenLogprob, sample
from ruvllm_cli.engine.sampling import SamplingParams
from ruvllm_cli.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from ruvllm_cli.errors import UsageError

if TYPE_CHECKING:
    from ruvllm_cli.engine.chat_call import ChatReply
    from ruvllm_cli.engine.tools import ToolRequest


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig()) -> None:
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or DEFAULT_CONTEXT, loaded.max_context)
        num_blocks = plan_num_blocks(loaded, config, self.max_model_len)
        # A pool smaller than one whole context caps the context: a longer request is
        # then a clear "too long" before it starts, not a failure once the pool runs out.
        self.context_before_kv_cap: int | None = None
        if num_blocks * config.block_size < self.max_model_len:
            self.context_before_kv_cap = self.max_model_len
            self.max_model_len = num_blocks * config.block_size
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        kv_dtype = kv_cache_dtype(loaded)
        swap_blocks = config.swap_space // kv_bytes_per_block(loaded.model.config, kv_dtype, config.block_size)
        if config.preemption_mode == "swap":
            check_swap_space(config.swap_space)
        self.swap_space = SwapSpace(swap_blocks) if config.preemption_mode == "swap" else None
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.token_budget(loaded.device.type), config.max_loras,
                            config.scheduling_policy, preemption_mode=config.preemption_mode),
            self.block_manager, self.swap_space)
        self.lora = LoRAManager(loaded.model, config.max_loras, config.max_lora_rank, loaded.dtype, loaded.device)
        self.runner = ModelRunner(loaded.model, num_blocks, config.block_size, loaded.device, loaded.dtype,
                                  self.lora, swap_blocks if self.swap_space is not None else 0, config.fused_decode,
                                  kv_dtype)
        self.stats = EngineStats()
        self._failed_last_step = False   # the last forward raised (a second one in a row is the engine's)
        self.requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(self.tokenizer, loaded.eos_token_ids, self.max_model_len,
                                       self.scheduler, self.stats)
        self._vocab_size = int(loaded.model.config.vocab_size)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        # Requests whose grammar is still compiling: they join the scheduler once it is
        # ready, so a new schema never holds back the requests already running.
        self._compiling: dict[str, Future[CompiledGrammar]] = {}

    @classmethod
    def from_path(cls, path: str, config: EngineConfig = EngineConfig()) -> "LLMEngine":
        return cls(load_model(path, config.device, config.quantization), config)

    # ---- requests ----------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, options: RequestOptions | None = None,
                    **fields: Any) -> Request:
        """Queue a request. `options` (or its fields as keywords: cache_salt, adapter,
        priority, user, session_id) say how it is served; `adapter` names a loaded
        LoRA adapter (None: the base model)."""
        params = params or SamplingParams()
        options = dataclasses.replace(options or RequestOptions(), **fields)
        prompt_ids = self.prepare_prompt(prompt)
        check_param_ids(params, self._vocab_size)
        adapter = self.adapter(options.adapter) if options.adapter else None
        request = Request(prompt_ids=prompt_ids, params=params, cache_salt=options.cache_salt,
                          priority=int(options.priority), user=options.user, session_id=options.session_id,
                          adapter_uid=adapter.uid if adapter else 0,
                          swappable=not (adapter is not None and adapter.mixture),
                          thinking=0 if params.reasoning_block is not None and params.reasoning_block.inside
                          else None)
        if request_id is not None:
            request.request_id = request_id
        if request.request_id in self.requests:
            raise UsageError(f"request id {request.request_id} is already in use")
        self.outputs.attach(request)
        self.requests[request.request_id] = request
        if params.structured is not None:
            self._compiling[request.request_id] = self.grammar_compiler.submit(params.structured)
        else:
            self.scheduler.add(request)
        return request

    @property
    def vocab_size(self) -> int:
        """Token ids the model takes: [0, vocab_size) (the config's, which may exceed the tokenizer's)."""
        return self._vocab_size

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """The model's recommended sampling (generation_config.json), for requests that
        leave a field out; the engine itself samples only with what each request says."""
        return dict(self.loaded.sampling_defaults)

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's memory: its blocks in the runner's dtype."""
        return self.block_manager.num_blocks * kv_bytes_per_block(self.loaded.model.config, self.runner.kv_dtype,
                                                                  self.config.block_size)

    # ---- LoRA adapters ---------------------------------------------------------------
    def adapter(self, name: str) -> Any:
        found = self.lora.get(name)
        if found is None:
            loaded = ", ".join(self.lora.names()) or "none"
            raise AdapterNotFoundError(f"no LoRA adapter named {name} is loaded (loaded: {loaded})")
        return found

    def add_lora(self, name: str, path: str | os.PathLike | Any) -> Any:
        """Serve a PEFT LoRA or X-LoRA adapter directory (or an adapter already read)
        under `name`."""
        adapter = read_adapter(name, path) if isinstance(path, (str, os.PathLike)) else path
        if adapter.mixture:
            self.runner.ensure_scaling_cache()   # before installing: it may not fit
        self.lora.install(adapter)
        return adapter

    def remove_lora(self, name: str) -> Any:
        """Stop serving an adapter; refused (AdapterInUseError) while a request uses it."""
        adapter = self.adapter(name)
        users = [r for r in self.requests.values() if r.adapter_uid == adapter.uid and not r.is_finished]
        if users:
            raise AdapterInUseError(f"adapter {name} is in use by {len(users)} request(s); "
                                    "unload it once they finish")
        removed = self.lora.remove(name)
        if removed.mixture and not any(a.mixture for a in self.lora.adapters.values()):
            self.runner.scaling_cache = None   # the last X-LoRA adapter gone: its KV pool too
        return removed

    def replace_lora(self, name: str, adapter: Any) -> Any:
        """Serve `adapter` (already read) in place of the one loaded as `name` (vLLM's
        load_inplace: a trainer's new weights under the same name), with a new uid, so
        no cached block of the old weights is reused; refused while a request uses the
        old one, and the old one stays if the new one cannot be installed."""
        old = self.adapter(name)
        self.lora.check(adapter)
        self.remove_lora(name)
        try:
            return self.add_lora(name, adapter)
        except BaseException:
            self.add_lora(name, old)
            raise

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Built on first use (1-3 s for a 150k vocabulary); any thread may ask."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self._vocab_size,
                                                         eos_token_ids=self.loaded.eos_token_ids)
            return self._grammar_compiler

    def prepare_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Tokenize and validate a prompt (UsageError if bad). Reads only what never
        changes after start-up, so any thread may call it."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(prompt_ids)
        return prompt_ids

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt_ids(prompt_ids, self.max_model_len, self._vocab_size)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request at any point; returns its final output (None if unknown)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._compiling.pop(request_id, None)
        self.scheduler.finish(request, FinishReason.CANCELLED)
        return self._finished(self.outputs.final(request, ""))

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._compiling)

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass over every scheduled token, sample, emit."""
        outputs = self._admit_compiled()
        plan = self.scheduler.schedule()
        if plan.swap_out or plan.swap_in:
            self.runner.swap(plan.swap_out, plan.swap_in)
        self.scheduler.swapped(plan)   # also when the prefix cache had every block back
        outputs += [self.outputs.final(r, "") for r in plan.rejected]
        self.stats.preemptions = self.scheduler.num_preemptions
        if plan.chunks:
            outputs += self._run(plan)
        elif self._compiling and not outputs:
            self._wait_for_a_grammar()
        return [self._finished(o) if o.finished else o for o in outputs]

    def _run(self, plan: SchedulerOutput) -> list[RequestOutput]:
        now = time.perf_counter()
        for chunk in plan.chunks:
            if chunk.request.timings.scheduled is None:
                chunk.request.timings.scheduled = now
        try:
            logits, sampled = self.runner.execute(plan.chunks)
        except Exception as error:  # noqa: BLE001 - see _forward_failed
            return self._forward_failed(plan, error)
        self._failed_last_step = False
        return self._ran(plan, logits, sampled)

    def _ran(self, plan: SchedulerOutput, logits: Any, sampled: list[Request]) -> list[RequestOutput]:
        """After a forward over `plan`'s chunks: their tokens counted as computed, the
        rows that complete a prompt or decode sampled."""
        self.scheduler.postprocess(plan)
        self.stats.steps += 1
        self.stats.last_step_tokens = plan.num_tokens
        self.stats.batched_tokens += plan.num_tokens
        if logits is None:
            return []
        tokens, logprobs = sample(logits, sampled)
        return [self.outputs.fail(r, t.message) if isinstance(t, SamplingFailure) else self.outputs.accept(r, t, lp)
                for r, t, lp in zip(sampled, tokens, logprobs)]

    def _forward_failed(self, plan: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A forward that raised must not stop a server, nor fail every other client's
        request beside the one whose input no check foresaw: each of the step's
        requests runs its chunks again alone, and only those that fail alone end, with
        the error. Nothing of the failed step was kept (the scheduler had not counted
        its tokens as computed, so no block it wrote joined the prefix cache; the rerun
        writes the same KV slots again; nothing was sampled, so seeded replies replay).
        A step whose every request fails alone, right after such a step, is the
        engine's own failure (a device left broken, say): raised; unless every request
        that failed ran on one LoRA adapter, whose requests alone it fails (an adapter
        no check found wrong had stopped the engine at its second request)."""
        if self._failed_last_step:
            raise error
        by_request: dict[int, list[ScheduledChunk]] = {}
        for chunk in plan.chunks:
            by_request.setdefault(id(chunk.request), []).append(chunk)
        outputs: list[RequestOutput] = []
        failed = 0
        adapters: set[int] = set()
        for chunks in by_request.values():
            request = chunks[0].request
            if request.is_finished:
                continue
            try:
                if len(by_request) == 1:
                    raise error   # it ran alone already
                logits, sampled = self.runner.execute(chunks)
            except Exception as alone:  # noqa: BLE001 - this request's own failure
                failed += 1
                adapters.add(request.adapter_uid)
                message = f"the model failed on this request's step ({type(alone).__name__}: {alone})"
                outputs.append(self.outputs.fail(request, message))
                continue
            outputs += self._ran(SchedulerOutput(chunks=chunks), logits, sampled)
        one_adapter = len(adapters) == 1 and 0 not in adapters
        self._failed_last_step = failed == len(by_request) and not one_adapter
        self.check_integrity()
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar is ready join the scheduler; a failed compile ends its request."""
        outputs = []
        for request_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            request = self.requests[request_id]
            try:
                request.grammar = future.result().matcher()
            except Exception as error:  # noqa: BLE001 - GrammarError, or the compile pool shut down
                outputs.append(self.outputs.fail(request, f"grammar: {error}"))
                continue
            self.scheduler.add(request)
        return outputs

    def _wait_for_a_grammar(self) -> None:
        # Nothing to run but compiles in flight: wait a little instead of spinning.
        from concurrent.futures import FIRST_COMPLETED, wait

        wait(list(self._compiling.values()), timeout=0.05, return_when=FIRST_COMPLETED)

    def _finished(self, output: RequestOutput) -> RequestOutput:
        del self.requests[output.request_id]
        return output

    # ---- conveniences -------------------------------------------------------------
    def generate(self, prompts: Iterable[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapters: str | Sequence[str | None] | None = None) -> list["Completion"]:
        """Run prompts to completion together; results in prompt order. `adapters`:
        one LoRA adapter name for all, or one per prompt (None: the base model)."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if adapters is None or isinstance(adapters, str):
            adapters = [adapters] * len(prompts)
        requests = [self.add_request(p, sp, adapter=a) for p, sp, a in zip(prompts, params, adapters)]
        results = {r.request_id: Completion(r.request_id) for r in requests}
        while self.has_unfinished:
            for output in self.step():
                results[output.request_id].add(output)
        return [results[r.request_id] for r in requests]

    def chat(self, messages: Sequence[dict], params: SamplingParams | None = None,
             tools: "ToolRequest | None" = None, tool_parser: str | None = None) -> "ChatReply":
        """One chat reply through the model's template; with `tools`, the calls the
        model made (or was forced to make by `tools.choice`) come back parsed."""
        from ruvllm_cli.engine.chat_call import chat

        return chat(self, messages, params, tools, tool_parser)

    def live_requests(self) -> list[Request]:
        return self.scheduler.live_requests()

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.live_requests())
        if self.swap_space is not None:
            self.swap_space.check_integrity(self.live_requests())


def check_prompt_ids(prompt_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """A prompt the engine can take (UsageError if not): non-empty, room for a reply,
    ids in the vocabulary. Also what a server in front of remote engines checks."""
    if not prompt_ids:
        raise UsageError("the prompt is empty")
    if len(prompt_ids) >= max_model_len:
        raise UsageError(f"the prompt has {len(prompt_ids)} tokens; the context limit is "
                         f"{max_model_len}, including the reply")
    if not all(isinstance(i, int) for i in prompt_ids):
        raise UsageError("prompt token ids must be integers")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise UsageError(f"prompt token ids must be in [0, {vocab_size})")


def check_param_ids(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias's and stop_token_ids' ids among the model's logits (UsageError if not):
    one outside had failed the whole batch's sampling step, and with it the engine."""
    for name, ids in (("logit_bias", [token for token, _ in params.logit_bias]),
                      ("stop_token_ids", list(params.stop_token_ids))):
        outside = next((token for token in ids if not 0 <= token < vocab_size), None)
        if outside is not None:
            raise UsageError(f"{name}: token id {outside} is outside the vocabulary [0, {vocab_size})")


@dataclass
class Completion:
    """A finished request's accumulated outputs (for `LLMEngine.generate`)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    stop_string: str | None = None

    def add(self, output: RequestOutput) -> None:
        self.token_ids += output.token_ids
        self.text += output.text
        self.logprobs += output.logprobs
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reason, self.error, self.stop_string = output.finish_reason, output.error, output.stop_string


def check_swap_space(swap_space: int) -> None:
    """The swap pool lives in the CPU's memory: more than is free had failed in the
    allocator with its own message (an `enforce fail` at alloc_cpu.cpp)."""
    import torch

    free = free_memory(torch.device("cpu"))
    if swap_space > free:
        raise UsageError(f"--swap-space {swap_space / 2**30:.1f} GiB is more than the {free / 2**30:.1f} GiB of "
                         "memory free", "give a smaller --swap-space (default 1 GiB)")


def plan_num_blocks(loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> int:
    """KV blocks from the memory budget: --kv-cache-memory if given, else a share of
    free memory, capped by what max_num_seqs sequences of max_model_len can use."""
    per_block = kv_bytes_per_block(loaded.model.config, kv_cache_dtype(loaded), config.block_size)
    if config.kv_cache_memory is not None:
        free = free_memory(loaded.device)
        if config.kv_cache_memory > free:
            raise UsageError(f"--kv-cache-memory {config.kv_cache_memory / 2**30:.1f} GiB is more than the "
                             f"{free / 2**30:.1f} GiB free on {loaded.device.type}",
                             "give a smaller --kv-cache-memory, or leave it out to take a share of free memory")
        return max(1, config.kv_cache_memory // per_block)
    share = 0.9 if loaded.device.type == "cuda" else config.kv_cache_fraction
    budget = int(free_memory(loaded.device) * share)
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(budget // per_block, useful))
