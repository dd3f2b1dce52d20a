"""What happens to a request after each sampled token: timings, grammar advance,
detokenizing, stop strings and EOS, the finish decision, and the output handed back.

`LLMEngine.step` runs the model and the sampler; everything per token after that
lives here, so the engine loop stays a short list of stages.
"""

from __future__ import annotations

import time
from typing import Any, Collection

import torch

from ruvllm_cli.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from ruvllm_cli.engine.outputs import EngineStats, RequestError, RequestOutput
from ruvllm_cli.engine.request import FinishReason, Request
from ruvllm_cli.engine.sampler import TokenLogprob
from ruvllm_cli.engine.scheduler import Scheduler


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: Collection[int], max_model_len: int,
                 scheduler: Scheduler, stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.stats = stats

    def attach(self, request: Request) -> None:
        """Give a new request its per-sequence state (text, stop strings, seed)."""
        params = request.params
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_ids,
                                                     params.skip_special_tokens, params.kept_special_tokens)
        request.stop_matcher = StopMatcher(params.stop, params.stop_fence)
        # What _is_eos would end the reply on, held back until min_tokens, and while a
        # constraint waits out a reasoning block: ended there, the reply has no answer.
        # Under a constraint with ignore_eos, EOS too, for as long as the grammar can go on
        # (the grammar took a sampled EOS as its end: "[0-9]+" stopped after 9 of 50 tokens).
        grammar_ignoring_eos = params.structured is not None and params.ignore_eos
        if params.min_tokens or grammar_ignoring_eos or (params.structured is not None
                                                         and params.reasoning_block is not None):
            ending = set(params.stop_token_ids) | (
                self.eos_token_ids if grammar_ignoring_eos or not params.ignore_eos else set())
            request.held_ids = tuple(sorted(ending))
        if params.seed is not None:
            request.generator = torch.Generator(device="cpu").manual_seed(params.seed)

    def accept(self, request: Request, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        """Take one sampled token: the request's output for this step, final or not."""
        self._stamp(request)
        request.append_token(token)
        self.stats.generated_tokens += 1
        reasoning = self._advance_reasoning(request, token)
        grammar_ok, grammar_done = (True, False) if reasoning else self._advance_grammar(request, token)
        is_eos = self._is_eos(request, token)
        # A stop token's text stays out of the reply unless include_stop_str_in_output
        # (vLLM's rule; an EOS, special, decodes to nothing where specials are skipped).
        keep = not is_eos or request.params.include_stop_str_in_output
        text, hit_stop = self._text(request, token) if keep else ("", False)
        reason = self._finish_reason(request, is_eos or hit_stop or grammar_done)
        if not grammar_ok:
            request.error = self._grammar_refusal(request, token)
            reason = FinishReason.ERROR
        if reason is None:
            return self._output(request, [token], text, logprob)
        self.scheduler.finish(request, reason)
        if not hit_stop:
            text += self._flush(request)
        elif request.params.include_stop_str_in_output and request.stop_matcher is not None:
            text += request.stop_matcher.matched or ""
        return self.final(request, text, [token], logprob)

    def _grammar_refusal(self, request: Request, token: int) -> str:
        """Why the grammar refused a token its own mask allowed. An added token whose text
        the grammar forces (a choice of "<tool_call>"): llguidance's mask offers the token
        where the forced text tokenizes to it, and its lexer then takes added tokens only
        by id (`<[id]>` in Lark), so the request cannot go on: the request's doing. So is
        a grammar whose parser outgrows llguidance's limits ("Current row has 2399 items;
        max is 2000": 501 optional properties, a right-recursive Lark rule after 2,000
        tokens), which had been a 500 saying only that the token was refused."""
        if token in getattr(self.tokenizer, "added_tokens_decoder", {}):
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            return RequestError(f"the constraint asks for the text {text!r}, which this model's tokenizer holds "
                                f"as the added token {token}: constrained decoding cannot write it as text")
        reason = request.grammar.error if request.grammar is not None else ""
        if reason:
            return RequestError(f"the grammar could not go on after {len(request.output_ids) - 1} tokens: "
                                f"{reason}")
        return f"token {token} was not allowed by the request's grammar"

    def fail(self, request: Request, message: str) -> RequestOutput:
        """End one request with an error (its sampling failed); the rest go on."""
        request.error = message
        self.scheduler.finish(request, FinishReason.ERROR)
        return self.final(request, "")

    def final(self, request: Request, text: str, tokens: list[int] | None = None,
              logprob: TokenLogprob | None = None) -> RequestOutput:
        output = self._output(request, tokens or [], text, logprob)
        output.finished = True
        output.finish_reason = request.finish_reason
        output.error = request.error
        output.stop_string = request.stop_matcher.matched if request.stop_matcher is not None else None
        self.stats.prompt_tokens += request.num_prompt_tokens
        return output

    # ---- the stages -----------------------------------------------------------------
    def _stamp(self, request: Request) -> None:
        now = time.perf_counter()
        if request.timings.first_token is None:
            request.timings.first_token = now
        request.timings.token_times.append(now)

    @staticmethod
    def _advance_reasoning(request: Request, token: int) -> bool:
        """Whether the token belongs to the reply's reasoning block (its markers too),
        which the constraint does not see and a thinking budget counts: open from the
        start or from a first token that is the start marker, closed for good at the
        end marker (a start marker later is text)."""
        block = request.params.reasoning_block
        if block is None:
            return False
        if request.thinking is not None:
            request.thinking = None if token == block.end_id else request.thinking + 1
            return True
        if len(request.output_ids) == 1 and token == block.start_id:
            request.thinking = 0
            return True
        return False

    def _advance_grammar(self, request: Request, token: int) -> tuple[bool, bool]:
        """(the grammar took the token, the grammar is complete and allows no more)."""
        if request.grammar is None:
            return True, False
        accepted = request.grammar.accept(token)
        return accepted, accepted and request.grammar.is_finished

    def _is_eos(self, request: Request, token: int) -> bool:
        params = request.params
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)

    def _text(self, request: Request, token: int) -> tuple[str, bool]:
        assert request.detokenizer is not None and request.stop_matcher is not None
        return request.stop_matcher.feed(request.detokenizer.add(token))

    def _flush(self, request: Request) -> str:
        # A reply may end inside a multi-byte character: show what there is.
        assert request.detokenizer is not None and request.stop_matcher is not None
        matcher = request.stop_matcher
        return matcher.feed(request.detokenizer.flush())[0] + matcher.flush()

    def _finish_reason(self, request: Request, stopped: bool) -> FinishReason | None:
        if stopped:
            return FinishReason.STOP
        if len(request.output_ids) >= request.params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _output(self, request: Request, tokens: list[int], text: str,
                logprob: TokenLogprob | None) -> RequestOutput:
        matcher = request.stop_matcher
        return RequestOutput(
            request_id=request.request_id, token_ids=tokens, text=text,
            logprobs=[logprob] if logprob is not None else [],
            num_prompt_tokens=request.num_prompt_tokens, num_cached_tokens=request.num_cached_tokens,
            num_output_tokens=len(request.output_ids), timings=request.timings,
            written=matcher.written if matcher is not None else None)
