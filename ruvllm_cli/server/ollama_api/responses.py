"""Ollama's reply objects, from the choices routes.generate accumulates for every
endpoint (one choice: the API has no `n`).

A stream is one JSON object a line: `{"model", "created_at", "message": {"role",
"content"}, "done": false}` per piece of text (on /api/generate `"response"`
instead of `message`), a reasoning model's thinking in `thinking`, tool calls whole
once the reply has ended (Ollama sends them whole too), then a last object with
`done: true`, `done_reason` and the measured durations (nanoseconds, as Ollama's).
An error ends a stream with `{"error": "..."}`, which Ollama's clients raise."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Sequence

from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.server.bridge import Choice
from ruvllm_cli.server.errors import ApiError
from ruvllm_cli.server.sse import Chunk
from ruvllm_cli.server.tool_output import ToolReplies, arguments_object, complete_call

DONE_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def ollama_error_body(error: ApiError) -> dict[str, Any]:
    """Ollama's error shape: `{"error": "message"}` (its clients raise ResponseError with it)."""
    return {"error": error.message}


def timestamp(at: float | None = None) -> str:
    """RFC 3339 in UTC, as Ollama's `created_at` and `modified_at`."""
    moment = datetime.fromtimestamp(time.time() if at is None else at, timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


@dataclass(frozen=True)
class Clock:
    """When the handler started (time.perf_counter) and how long it waited for the
    model: its load, when the request had to load it."""

    started: float
    waited: float = 0.0


def durations(choice: Choice, clock: Clock) -> dict[str, Any]:
    """Ollama's counts and durations, measured: the prompt's evaluation from the
    engine's first step for the request to its first token, the generation from
    there to the request's end. A figure the engine did not report is left out."""
    stats: dict[str, Any] = {"total_duration": nanoseconds(time.perf_counter() - clock.started),
                             "load_duration": nanoseconds(clock.waited),
                             "prompt_eval_count": choice.num_prompt_tokens}
    timings = choice.timings
    if timings is not None and timings.scheduled is not None and timings.first_token is not None:
        stats["prompt_eval_duration"] = nanoseconds(timings.first_token - timings.scheduled)
    stats["eval_count"] = choice.num_output_tokens
    if timings is not None and timings.first_token is not None:
        end = timings.finished or (timings.token_times[-1] if timings.token_times else None)
        if end is not None:
            stats["eval_duration"] = nanoseconds(end - timings.first_token)
    return stats


@dataclass
class OllamaFormat:
    """routes.ResponseFormat for /api/chat (`kind` "chat") and /api/generate ("generate")."""

    kind: str
    model: str                       # the name the request gave, echoed as Ollama does
    clock: Clock
    tools: ToolReplies | None = None
    think: bool | None = None        # False: a reasoning model's thinking is left out

    def reply_object(self, text: str = "", thinking: str | None = None,
                calls: list[dict[str, Any]] | None = None, done: bool = False) -> dict[str, Any]:
        head: dict[str, Any] = {"model": self.model, "created_at": timestamp()}
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            head["message"] = message
        else:
            head["response"] = text
            if thinking:
                head["thinking"] = thinking
        head["done"] = done
        return head

    def _final(self, choice: Choice, text: str = "", thinking: str | None = None,
               calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body = self.reply_object(text, thinking, calls, done=True)
        body["done_reason"] = DONE_REASONS.get(choice.finish_reason) if choice.finish_reason else None
        return {**body, **durations(choice, self.clock)}

    def _thinking(self, choice: Choice) -> str | None:
        return choice.reasoning or None if self.think is not False else None

    def body(self, choices: Sequence[Choice]) -> dict[str, Any]:
        [choice] = choices
        if self.tools is not None:
            self.tools.settle(choice)
        return self._final(choice, choice.text, self._thinking(choice), self._calls(choice))

    def opening(self, choice: Choice) -> list[Chunk]:
        return []

    def reasoning(self, choice: Choice, text: str) -> list[Chunk]:
        return [self.reply_object(thinking=text)] if self.think is not False else []

    def deltas(self, choice: Choice, output: RequestOutput) -> list[Chunk]:
        text = self.tools.feed(choice, output.text).content if self.tools is not None else output.text
        return [self.reply_object(text)] if text else []

    def flush(self, choice: Choice) -> list[Chunk]:
        """The text a tool parser held back, then the calls, whole."""
        if self.tools is None:
            return []
        tail = self.tools.finish(choice).content
        calls = self._calls(choice)
        return [*([self.reply_object(tail)] if tail else []), *([self.reply_object(calls=calls)] if calls else [])]

    def final(self, choice: Choice) -> Chunk:
        return self._final(choice)

    def closing(self, choices: Sequence[Choice]) -> list[Chunk]:
        return []

    def error_chunks(self, error: ApiError) -> list[Chunk]:
        return [ollama_error_body(error)]

    def _calls(self, choice: Choice) -> list[dict[str, Any]]:
        """Complete calls only: Ollama's shape cannot mark one that `num_predict` cut (or
        the model broke) as partial, and its clients run what they get (LangChain's
        agent ran a cut call with `{}` for its required arguments); Ollama's own parser
        gives complete calls only. The other APIs keep a cut call, as OpenAI answers."""
        return [{"id": call.id, "function": {"index": index, "name": call.name,
                                             "arguments": arguments_object(call.arguments)}}
                for index, call in enumerate(c for c in choice.tool_calls if complete_call(c.arguments))]
