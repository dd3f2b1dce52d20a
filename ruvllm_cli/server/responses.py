"""OpenAI response bodies and stream chunks, built from accumulated choices.

`ChatFormat` and `CompletionFormat` share one shape (`ResponseFormat`) with
Anthropic's `MessagesFormat`, so a single generation path (routes.generate) serves
every endpoint, streaming or not."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.engine.sampler import TokenLogprob
from ruvllm_cli.server.bridge import Choice
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.sse import DONE, Chunk
from ruvllm_cli.server.token_text import TokenTexts
from ruvllm_cli.server.tool_output import ToolReplies, calls_json, delta_json

# Engine reasons that are also OpenAI's; cancelled and error never reach a body.
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, prefix: str, model: str) -> "ResponseMeta":
        return cls(f"{prefix}-{uuid.uuid4().hex}", model)

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}


class ResponseFormat(Protocol):
    """One endpoint's answers: a body, or a stream that opens each choice, sends
    its deltas (a reasoning model's reasoning first, then its answer), flushes what
    a parser held back, finishes it (`final`), and ends with `closing` (or with
    `error_chunks` when an error cut it short)."""

    def opening(self, choice: Choice) -> Sequence[Chunk]: ...
    def reasoning(self, choice: Choice, text: str) -> Sequence[Chunk]: ...
    def deltas(self, choice: Choice, output: RequestOutput) -> Sequence[Chunk]: ...
    def flush(self, choice: Choice) -> Sequence[Chunk]: ...
    def final(self, choice: Choice) -> Chunk: ...
    def closing(self, choices: Sequence[Choice]) -> Sequence[Chunk]: ...
    def error_chunks(self, error: ApiError) -> Sequence[Chunk]: ...
    def body(self, choices: Sequence[Choice]) -> dict[str, Any]: ...


class OpenAIStreamEnd:
    """How an OpenAI stream ends: the usage chunk when asked for, then [DONE]; after
    an error, its body and [DONE]."""

    include_usage: bool

    def usage_chunk(self, choices: Sequence[Choice]) -> dict[str, Any]:
        raise NotImplementedError

    def closing(self, choices: Sequence[Choice]) -> list[Chunk]:
        return [self.usage_chunk(choices), DONE] if self.include_usage else [DONE]

    def error_chunks(self, error: ApiError) -> list[Chunk]:
        return [error.body(), DONE]


def finish_reason(choice: Choice) -> str | None:
    if choice.tool_calls and choice.finish_reason is FinishReason.STOP:
        return "tool_calls"
    return FINISH_REASONS.get(choice.finish_reason) if choice.finish_reason else None


def usage(choices: Sequence[Choice]) -> dict[str, Any]:
    """Token counts; a prompt shared by n copies counts once, as OpenAI bills it."""
    first_copy: dict[int, Choice] = {}
    for choice in choices:
        first_copy.setdefault(choice.prompt_index, choice)
    prompt = sum(c.num_prompt_tokens for c in first_copy.values())
    cached = sum(c.num_cached_tokens for c in first_copy.values())
    completion = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def reasoning_tokens(choices: Sequence[Choice]) -> int | None:
    """Output tokens spent reasoning, over the choices of a reasoning model (None for
    another model, or where the end marker is not one token and they were not counted)."""
    counts = [c.reasoning_tokens for c in choices if c.markers is not None]
    return sum(counts) if counts and None not in counts else None   # type: ignore[arg-type]


# ---- chat -------------------------------------------------------------------------------
@dataclass
class ChatFormat(OpenAIStreamEnd):
    meta: ResponseMeta
    texts: TokenTexts
    top_logprobs: int | None = None       # None: no logprobs
    include_usage: bool = False
    tools: ToolReplies | None = None      # the model may call tools: parse its replies
    include_reasoning: bool = True        # False: a reasoning model's reasoning is left out (vLLM's field)

    def body(self, choices: Sequence[Choice]) -> dict[str, Any]:
        for choice in choices if self.tools else ():
            self.tools.settle(choice)  # type: ignore[union-attr]
        return {**self.meta.head("chat.completion"),
                "choices": [{"index": c.index, "message": self._message(c),
                             "logprobs": self._logprobs(c.logprobs),
                             "finish_reason": finish_reason(c)} for c in choices],
                "usage": self._usage(choices)}

    def _message(self, choice: Choice) -> dict[str, Any]:
        # No answer beside calls, or beside a reasoning model's reasoning: null, as vLLM's
        empty = None if choice.tool_calls or (choice.markers is not None and choice.reasoning) else ""
        message = {"role": "assistant", "content": choice.text or empty, "refusal": None}
        if choice.markers is not None and self.include_reasoning:
            # `reasoning` (vLLM's and Ollama's name now), `reasoning_content` (DeepSeek's, vLLM's before)
            message["reasoning"] = message["reasoning_content"] = choice.reasoning or None
        if choice.tool_calls:
            message["tool_calls"] = calls_json(choice.tool_calls)
        return message

    def _usage(self, choices: Sequence[Choice]) -> dict[str, Any]:
        counts = usage(choices)
        spent = reasoning_tokens(choices)
        if spent is not None:
            counts["completion_tokens_details"] = {"reasoning_tokens": spent}
        return counts

    def opening(self, choice: Choice) -> list[dict[str, Any]]:
        return [self._chunk(choice.index, {"role": "assistant", "content": ""})]

    def reasoning(self, choice: Choice, text: str) -> list[dict[str, Any]]:
        return [self._chunk(choice.index, {"reasoning": text, "reasoning_content": text})] \
            if self.include_reasoning else []

    def deltas(self, choice: Choice, output: RequestOutput) -> list[dict[str, Any]]:
        logprobs = self._logprobs(output.logprobs) if output.logprobs else None
        deltas = delta_json(self.tools.feed(choice, output.text)) if self.tools else (
            [{"content": output.text}] if output.text else [])
        if not deltas and logprobs is None:
            return []
        deltas = deltas or [{}]
        return [self._chunk(choice.index, d, logprobs=logprobs if i == 0 else None) for i, d in enumerate(deltas)]

    def flush(self, choice: Choice) -> list[dict[str, Any]]:
        """What a tool parser still held back when the reply ended."""
        deltas = delta_json(self.tools.finish(choice)) if self.tools else []
        return [self._chunk(choice.index, d) for d in deltas]

    def final(self, choice: Choice) -> dict[str, Any]:
        return self._chunk(choice.index, {}, finish=finish_reason(choice))

    def usage_chunk(self, choices: Sequence[Choice]) -> dict[str, Any]:
        return {**self.meta.head("chat.completion.chunk"), "choices": [], "usage": self._usage(choices)}

    def _chunk(self, index: int, delta: dict[str, Any], *, finish: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk = {**self.meta.head("chat.completion.chunk"),
                 "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None   # OpenAI's sign that a usage chunk follows
        return chunk

    def _logprobs(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return {"content": [self._token(lp) for lp in logprobs], "refusal": None}

    def _token(self, lp: TokenLogprob) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text, raw = self.texts.lookup(token_id)
            return {"token": text, "logprob": logprob, "bytes": raw}

        return {**entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(t, p) for t, p in lp.top[:self.top_logprobs or 0]]}


# ---- completions ----------------------------------------------------------------------------
@dataclass
class CompletionFormat(OpenAIStreamEnd):
    meta: ResponseMeta
    texts: TokenTexts
    logprobs: int | None = None
    include_usage: bool = False
    echo_texts: Sequence[str] = ()        # per prompt, prepended to its choices (`echo`)

    def body(self, choices: Sequence[Choice]) -> dict[str, Any]:
        return {**self.meta.head("text_completion"),
                "choices": [{"index": c.index, "text": self._echo(c) + c.text,
                             "logprobs": self._logprobs(c.logprobs, len(self._echo(c)), c.token_spans),
                             "finish_reason": finish_reason(c)} for c in choices],
                "usage": usage(choices)}

    def opening(self, choice: Choice) -> list[dict[str, Any]]:
        echo = self._echo(choice)
        return [self._chunk(choice.index, echo)] if echo else []

    def reasoning(self, choice: Choice, text: str) -> list[dict[str, Any]]:
        return []   # a completion is the model's text as it is

    def deltas(self, choice: Choice, output: RequestOutput) -> list[dict[str, Any]]:
        if not output.text and not (output.logprobs and self.logprobs is not None):
            return []
        # `choice` already holds this output: its text so far ends with this delta.
        spans = choice.token_spans[len(choice.token_spans) - len(output.logprobs):]
        logprobs = self._logprobs(output.logprobs, len(self._echo(choice)), spans)
        return [self._chunk(choice.index, output.text, logprobs=logprobs)]

    def flush(self, choice: Choice) -> list[dict[str, Any]]:
        return []

    def final(self, choice: Choice) -> dict[str, Any]:
        return self._chunk(choice.index, "", finish=finish_reason(choice))

    def usage_chunk(self, choices: Sequence[Choice]) -> dict[str, Any]:
        return {**self.meta.head("text_completion"), "choices": [], "usage": usage(choices)}

    def _echo(self, choice: Choice) -> str:
        return self.echo_texts[choice.prompt_index] if self.echo_texts else ""

    def _chunk(self, index: int, text: str, *, finish: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        chunk = {**self.meta.head("text_completion"),
                 "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, logprobs: Sequence[TokenLogprob], echo: int,
                  spans: Sequence[tuple[int, int]]) -> dict[str, Any] | None:
        """The legacy format: parallel arrays, `text_offset` where each token shows in
        the text after `echo` characters of echoed prompt: its own text back from the end
        of its span (`Choice.token_spans`), or the span's start where its text is longer
        (a skipped special token, a character's last bytes)."""
        if self.logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for lp, (start, end) in zip(logprobs, spans):
            text = self.texts.text(lp.token_id)
            # Keyed by text, so tokens that read alike share an entry: the likeliest of them
            # (the list is best first; the last one had won), the chosen token its own value.
            alternatives: dict[str, float] = {}
            for token, value in lp.top[:self.logprobs]:
                alternatives.setdefault(self.texts.text(token), value)
            alternatives[text] = lp.logprob
            tokens.append(text)
            token_logprobs.append(lp.logprob)
            tops.append(alternatives)
            offsets.append(echo + max(start, end - len(text)))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
