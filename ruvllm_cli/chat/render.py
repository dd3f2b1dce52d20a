"""What the user sees: the banner, the streamed reply, the dim stats line, notices.

`TerminalRenderer` is the REPL's (everything on the terminal, through rich);
`PipeRenderer` is for scripts (the reply alone on stdout, notices on stderr).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from rich.console import Console
from rich.markup import escape

from ruvllm_cli.engine.request import FinishReason

if TYPE_CHECKING:
    from ruvllm_cli.chat.reply import Reply, ReplyStats
    from ruvllm_cli.chat.session import ChatSession
    from ruvllm_cli.engine.grammar import GrammarSpec


# C0 controls but tab and newline, DEL, and C1: a model's text (or a loaded chat's)
# must not reach the terminal as escape sequences (colours, titles, OSC 52 clipboard
# writes, hidden text). Shown as \\xNN instead; a carriage return (a CRLF line end) dropped.
_CONTROLS = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7f, 0xa0)) if code not in (0x09, 0x0a)}
_CONTROLS[0x0d] = None


def terminal_safe(text: str) -> str:
    return text.translate(_CONTROLS)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_rate(tokens_per_s: float | None) -> str:
    return "n/a tok/s" if tokens_per_s is None else f"{tokens_per_s:.1f} tok/s"


def format_stats_line(stats: "ReplyStats") -> str:
    """`12 tokens · TTFT 35 ms · 120.4 tok/s` (decode rate, from the engine's timings)."""
    noun = "token" if stats.tokens == 1 else "tokens"
    return f"{stats.tokens} {noun} · TTFT {format_duration(stats.ttft_s)} · {format_rate(stats.decode_tok_s)}"


def format_structured(spec: "GrammarSpec") -> str:
    """The banner's line for --json / --json-schema."""
    shape = "any JSON object (--json)" if spec.kind == "json_object" else "JSON valid against --json-schema"
    return f"Every reply is {shape}"


def adapter_label(name: str | None) -> str:
    """`adapter NAME`, or `the base model` for None."""
    return f"adapter {name}" if name is not None else "the base model"


def format_adapters(current: str | None, loaded: Sequence[str]) -> str:
    """The banner's line for --lora: the adapter in use and the loaded ones."""
    return f"Replies come from {adapter_label(current)} (LoRA adapters: {', '.join(loaded)}; /adapter switches)"


def no_answer(reply: "Reply", max_tokens: int) -> str:
    """Why a reasoning model's reply has no answer (Reply.thinking_only)."""
    if reply.interrupted:
        why = "it was stopped"
    elif reply.finish_reason is FinishReason.LENGTH:
        why = (f"it reached the {max_tokens}-token limit (/max raises it)" if reply.stats.tokens >= max_tokens
               else "the context window is full (/clear starts afresh)")
    else:
        why = "the model ended it"
    return f"no answer: the reply ended while the model was thinking ({why})"


def format_stats_details(reply: "Reply") -> list[tuple[str, str]]:
    """The rows of /stats."""
    stats = reply.stats
    return [
        ("tokens", f"{stats.tokens} ({reply.finish_reason.value})"),
        ("TTFT", format_duration(stats.ttft_s)),
        ("decode", format_rate(stats.decode_tok_s)),
        ("total", format_duration(stats.total_s)),
        ("prompt", f"{stats.prompt_tokens} tokens, {stats.cached_tokens} from the prefix cache"),
    ]


class Renderer(Protocol):
    def reply_text(self, text: str) -> None: ...
    def reply_reasoning(self, text: str) -> None: ...   # a reasoning model's, before its answer
    def reply_end(self, reply: "Reply", max_tokens: int) -> None: ...
    def rows(self, rows: list[tuple[str, str]]) -> None: ...
    def info(self, message: str) -> None: ...
    def warn(self, message: str) -> None: ...
    def error(self, message: str, hint: str | None = None) -> None: ...


class TerminalRenderer:
    """Rich output for the interactive REPL."""

    def __init__(self, console: Console, show_reasoning: bool = True) -> None:
        self.console = console
        self.show_reasoning = show_reasoning
        self._thinking = False   # reasoning is on screen and the answer has not begun

    def banner(self, description: str, session: "ChatSession", adapters: Sequence[str] = ()) -> None:
        self.console.print(f"[bold]ruvllm chat[/bold] · {escape(terminal_safe(description))}")
        if session.system_prompt:
            self.console.print(f"[dim]System: {escape(terminal_safe(session.system_prompt))}[/dim]")
        if adapters:
            self.console.print(f"[dim]{escape(terminal_safe(format_adapters(session.adapter, adapters)))}[/dim]")
        if session.structured is not None:
            self.console.print(f"[dim]{escape(format_structured(session.structured))}[/dim]")
        self.console.print('[dim]/help for commands · """ for multi-line input · '
                           'Ctrl-C stops a reply · Ctrl-D quits[/dim]\n')

    def reply_reasoning(self, text: str) -> None:
        """A reasoning model's reasoning, dim under a "Thinking" line (--hide-thinking: not shown)."""
        if not self.show_reasoning:
            return
        if not self._thinking:
            self._thinking = True
            self.console.print("[dim]Thinking…[/dim]")
        self.console.out(terminal_safe(text), end="", style="dim italic", highlight=False)

    def reply_text(self, text: str) -> None:
        self._end_thinking()
        self.console.out(terminal_safe(text), end="", highlight=False)

    def _end_thinking(self, done: bool = True) -> None:
        if self._thinking:
            self._thinking = False
            self.console.print("\n[dim]…done thinking.[/dim]\n" if done else "")

    def reply_end(self, reply: "Reply", max_tokens: int) -> None:
        self._end_thinking(done=False)   # a reply that ends while thinking: nothing was done
        self.console.out("")
        if reply.thinking_only:
            self.warn(no_answer(reply, max_tokens) + "; your message is not kept (send it again)")
            self.console.print(f"[dim]{escape(format_stats_line(reply.stats))}[/dim]")
            return
        if reply.interrupted:
            self.console.print("[yellow]Interrupted:[/yellow] the partial reply stays in the "
                               "conversation (/retry generates it again)")
        elif reply.finish_reason is FinishReason.ERROR:
            self.error(reply.error or "the engine failed while generating")
            return
        line = format_stats_line(reply.stats)
        if reply.finish_reason is FinishReason.LENGTH and reply.stats.tokens < max_tokens:
            line += " · stopped: the context window is full (/clear starts afresh)"
        elif reply.finish_reason is FinishReason.LENGTH:
            line += f" · stopped at the {max_tokens}-token limit (/max)"
        self.console.print(f"[dim]{escape(line)}[/dim]")

    def rows(self, rows: list[tuple[str, str]]) -> None:
        width = max((len(key) for key, _ in rows), default=0)
        for key, value in rows:
            self.console.print(f"  [bold]{escape(key.ljust(width))}[/bold]  {escape(terminal_safe(value))}")

    # Notices quote what a user or a loaded chat file wrote (a model's name, an adapter's,
    # an unknown command): each goes through terminal_safe, as the reply does.
    def info(self, message: str) -> None:
        self.console.print(escape(terminal_safe(message)))

    def warn(self, message: str) -> None:
        self.console.print(f"[yellow]Warning:[/yellow] {escape(terminal_safe(message))}")

    def error(self, message: str, hint: str | None = None) -> None:
        self.console.print(f"[bold red]Error:[/bold red] {escape(terminal_safe(message))}")
        if hint:
            self.console.print(f"[dim]Hint: {escape(terminal_safe(hint))}[/dim]")


class PipeRenderer:
    """For `echo hi | ruvllm chat MODEL`: only the reply on stdout, the rest on stderr.
    With `whole` (a JSON reply), the reply goes out at its end, and only if the token
    limit did not cut it: stdout is then one JSON document or nothing."""

    def __init__(self, notices: Console, whole: bool = False, show_reasoning: bool = True) -> None:
        self.notices = notices
        self.whole = whole
        self.show_reasoning = show_reasoning
        self._held: list[str] = []
        self._thinking = False

    @staticmethod
    def _shown(text: str, stream: object) -> str:
        """The model's text as written, for a file or a pipe (a script gets its bytes);
        through terminal_safe where the stream is a terminal (`echo hi | ruvllm chat M`
        typed in a shell: the model's escape sequences had reached it)."""
        isatty = getattr(stream, "isatty", None)
        return terminal_safe(text) if isatty is not None and isatty() else text

    def reply_reasoning(self, text: str) -> None:
        """A reasoning model's reasoning goes to stderr: stdout holds the answer alone."""
        if self.show_reasoning:
            self._thinking = True
            sys.stderr.write(self._shown(text, sys.stderr))
            sys.stderr.flush()

    def _end_thinking(self) -> None:
        if self._thinking:
            self._thinking = False
            sys.stderr.write("\n")
            sys.stderr.flush()

    def reply_text(self, text: str) -> None:
        self._end_thinking()
        if self.whole:
            self._held.append(text)
            return
        sys.stdout.write(self._shown(text, sys.stdout))
        sys.stdout.flush()

    def reply_end(self, reply: "Reply", max_tokens: int) -> None:
        self._end_thinking()
        if reply.thinking_only:   # stdout stays empty: there is no answer to print
            self.error(no_answer(reply, max_tokens).replace("/max", "--max-tokens"))
            return
        held, self._held = "".join(self._held), []
        if self.whole and reply.finish_reason is FinishReason.LENGTH:
            self.info(f"The reply so far: {held}")
        else:
            sys.stdout.write(self._shown(held, sys.stdout) + "\n")
        sys.stdout.flush()
        if reply.interrupted:
            self.warn("interrupted; the reply above is partial")
        elif reply.finish_reason is FinishReason.ERROR:
            self.error(reply.error or "the engine failed while generating")

    def rows(self, rows: list[tuple[str, str]]) -> None:
        for key, value in rows:
            self.info(f"{key}: {value}")

    def info(self, message: str) -> None:
        self.notices.print(escape(terminal_safe(message)))

    def warn(self, message: str) -> None:
        self.notices.print(f"[yellow]Warning:[/yellow] {escape(terminal_safe(message))}")

    def error(self, message: str, hint: str | None = None) -> None:
        self.notices.print(f"[bold red]Error:[/bold red] {escape(terminal_safe(message))}")
        if hint:
            self.notices.print(f"[dim]Hint: {escape(terminal_safe(hint))}[/dim]")
