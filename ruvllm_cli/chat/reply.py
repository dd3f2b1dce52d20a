"""Streams one reply from the engine loop, with Ctrl-C cancelling it (and keys typed
meanwhile kept out of it), and measures it.

The numbers come from the engine's own timestamps (RequestOutput.timings), taken on
the engine thread when each token was sampled, not from when the terminal showed it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ruvllm_cli.engine.request import FinishReason

if TYPE_CHECKING:
    from ruvllm_cli.engine.loop import EngineLoop, RequestStream
    from ruvllm_cli.engine.reasoning import ReasoningSplitter
    from ruvllm_cli.engine.outputs import RequestOutput
    from ruvllm_cli.engine.sampling import SamplingParams


@dataclass(frozen=True)
class ReplyStats:
    tokens: int                  # generated tokens (EOS included)
    prompt_tokens: int
    cached_tokens: int           # prompt tokens whose KV came from the prefix cache
    ttft_s: float | None         # request arrival -> first token
    decode_tok_s: float | None   # tokens after the first / time between first and last
    total_s: float | None

    @classmethod
    def from_output(cls, final: "RequestOutput") -> "ReplyStats":
        timings = final.timings
        ttft = decode = total = None
        if timings is not None:
            if timings.first_token is not None:
                ttft = timings.first_token - timings.arrival
            stamps = timings.token_times
            if len(stamps) >= 2 and stamps[-1] > stamps[0]:
                decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
            end = timings.finished or (stamps[-1] if stamps else None)
            if end is not None:
                total = end - timings.arrival
        return cls(final.num_output_tokens, final.num_prompt_tokens, final.num_cached_tokens,
                   ttft, decode, total)


@dataclass(frozen=True)
class Reply:
    text: str                    # the answer (a reasoning model's reasoning apart)
    finish_reason: FinishReason
    stats: ReplyStats
    error: str | None = None
    reasoning: str = ""

    @property
    def interrupted(self) -> bool:
        return self.finish_reason is FinishReason.CANCELLED

    @property
    def thinking_only(self) -> bool:
        """A reasoning model's reply that ended (stopped, cut by the token limit, or by the
        model) before its answer began: there is nothing to keep."""
        return not self.text and bool(self.reasoning) and self.finish_reason is not FinishReason.ERROR


def stream_reply(loop: "EngineLoop", prompt_ids: Sequence[int], params: "SamplingParams",
                 on_text: Callable[[str], Any], adapter: str | None = None,
                 splitter: "ReasoningSplitter | None" = None,
                 on_reasoning: Callable[[str], Any] | None = None) -> Reply:
    """Generate a reply with LoRA `adapter` (None: the base model), handing each new
    piece of text to `on_text` as it arrives; with a reasoning model's `splitter`, its
    reasoning goes to `on_reasoning` and the answer to `on_text`.

    Ctrl-C (SIGINT) cancels the request instead of raising: the stream then ends with
    a `cancelled` output, and the text so far is the reply. Keys typed on a terminal
    meanwhile are not echoed into the reply (`typed_ahead_unechoed`)."""
    stream = loop.submit(list(prompt_ids), params, adapter=adapter)
    parts: list[str] = []
    thoughts: list[str] = []

    def hand_out(reasoning: str, text: str) -> None:
        if reasoning:
            thoughts.append(reasoning)
            if on_reasoning is not None:
                on_reasoning(reasoning)
        if text:
            parts.append(text)
            on_text(text)

    final: RequestOutput | None = None
    with cancel_on_interrupt(stream), typed_ahead_unechoed():
        for output in stream:
            if splitter is None:
                hand_out("", output.text)
            else:
                split = splitter.feed(output.text)
                hand_out(split.reasoning, split.content)
            final = output
    if splitter is not None:
        split = splitter.finish()
        hand_out(split.reasoning, split.content)
    assert final is not None and final.finished
    return Reply("".join(parts), final.finish_reason or FinishReason.STOP, ReplyStats.from_output(final), final.error,
                 "".join(thoughts))


@contextmanager
def cancel_on_interrupt(stream: "RequestStream") -> Iterator[None]:
    """While active, SIGINT cancels `stream` (once) instead of raising KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    cancelled = threading.Event()

    def on_sigint(signum: int, frame: Any) -> None:
        # Runs between bytecodes of the main thread, which is waiting on the stream's
        # queue; cancel() only posts to the engine thread's command queue.
        if not cancelled.is_set():
            cancelled.set()
            stream.cancel()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _terminal() -> tuple[int, list[Any]] | None:
    """stdin's terminal and its settings now, where the main thread (the one that may
    handle signals) asks; None without one (Windows, stdin replaced, closed or a pipe)."""
    try:
        import termios
    except ImportError:   # Windows: its console does not echo while no one reads
        return None
    try:
        fd = sys.stdin.fileno()
        before = termios.tcgetattr(fd) if sys.stdin.isatty() else None
    except (AttributeError, ValueError, OSError, termios.error):   # replaced, closed, or no terminal
        before = None
    if before is None or threading.current_thread() is not threading.main_thread():
        return None
    return fd, before


@contextmanager
def terminal_restored_on_sigterm() -> Iterator[None]:
    """Killed (SIGTERM) inside this, the terminal gets its settings of now back before
    the process goes: prompt-toolkit keeps it raw at the REPL's prompt, and a reply
    turns its echo off (`typed_ahead_unechoed`); either had been left so."""
    found = _terminal()
    if found is None:
        yield
        return
    import termios

    fd, before = found

    def on_sigterm(signum: int, frame: Any) -> None:
        termios.tcsetattr(fd, termios.TCSANOW, before)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def typed_ahead_unechoed() -> Iterator[None]:
    """While a reply streams to a terminal, the terminal does not echo keys typed into
    it: Ctrl-C's "^C" no longer lands in the middle of the reply, nor do the letters of
    a next question typed early. Those wait in the terminal's input, as a shell's
    typed-ahead line does, and the next prompt starts with them. Only the echo flags
    change (Ctrl-C still signals); they are put back as they were, the input kept."""
    found = _terminal()
    if found is None:
        yield
        return
    import termios

    fd, before = found
    quiet = list(before)
    quiet[3] &= ~(termios.ECHO | termios.ECHOCTL)
    with terminal_restored_on_sigterm():
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
        try:
            yield
        finally:
            termios.tcsetattr(fd, termios.TCSANOW, before)
