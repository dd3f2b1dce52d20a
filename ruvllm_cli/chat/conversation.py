"""One chat's turns: the session, the engine loop it talks to, and where output goes.

Each turn renders the whole conversation again; the engine's prefix cache finds the
earlier turns' blocks (same tokens, no cache salt), so only the new tokens are
prefilled and the TTFT does not grow with the length of the conversation. The cache
keeps each LoRA adapter's blocks apart, so the first turn after `/adapter` prefills
the whole conversation once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ruvllm_cli.chat.reply import Reply, stream_reply
from ruvllm_cli.chat.session import ChatSession
from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.errors import UsageError

if TYPE_CHECKING:
    from ruvllm_cli.chat.render import Renderer
    from ruvllm_cli.engine.loop import EngineLoop
    from ruvllm_cli.engine.reasoning import Reasoning

# `/adapter base` (or `none`) and `--adapter base` mean the base model; chat refuses
# adapters named so.
BASE_MODEL_WORDS = ("base", "none")


@dataclass
class Conversation:
    session: ChatSession
    loop: "EngineLoop"
    renderer: "Renderer"
    chats_dir: Path                      # where /save writes when given no file
    last_reply: Reply | None = None
    adapters: tuple[str, ...] = ()       # the LoRA adapters the engine serves, by name
    reasoning: "Reasoning | None" = None  # a reasoning model's markers: its reasoning shown apart, not kept
    more_turns: bool = True              # False piped: one reply, so no warning about the turns to come

    def use_adapter(self, name: str | None) -> None:
        """Generate the next replies with LoRA adapter `name` (None: the base model);
        UsageError, changing nothing, when no adapter of that name is loaded."""
        if name is not None:
            check_adapter(name, self.adapters)
        self.session.adapter = name

    def send(self, text: str) -> Reply:
        """Add the user's message and stream the reply to it. On failure the message
        is taken back out, so the conversation never holds an unanswered turn."""
        self.session.add_user(text)
        try:
            reply = self._respond()
        except BaseException:
            self.session.drop_last_user()
            raise
        if reply.finish_reason is FinishReason.ERROR or reply.thinking_only:
            self.session.drop_last_user()
        return reply

    def retry(self) -> Reply:
        """Generate the last reply again (or, after a user message with none, its first);
        the old one comes back if that fails."""
        previous = self.session.pop_last_reply()
        try:
            reply = self._respond()
        except BaseException:
            if previous is not None:
                self.session.messages.append(previous)
            raise
        if (reply.finish_reason is FinishReason.ERROR or reply.thinking_only) and previous is not None:
            self.session.messages.append(previous)
        return reply

    def _respond(self) -> Reply:
        """Stream a reply to the last user message (trimming old turns to fit first)."""
        fit = self.session.fit_context()
        if fit.dropped_turns:
            turns = "turn" if fit.dropped_turns == 1 else "turns"
            self.renderer.warn(f"dropped the {fit.dropped_turns} oldest {turns} to fit the "
                               f"{self.session.context_limit}-token context window")
        params, splitter = self.session.sampling_params(), None
        if self.reasoning is not None:
            plan = self.reasoning.plan(self.session.template.tokenizer, fit.prompt_ids, params.structured is not None)
            params = plan.sampling(params, self.reasoning)
            splitter = self.reasoning.splitter(plan.inside)
        reply = stream_reply(self.loop, fit.prompt_ids, params, self.renderer.reply_text, self.session.adapter,
                             splitter, self.renderer.reply_reasoning if splitter is not None else None)
        self.renderer.reply_end(reply, self.session.settings.max_tokens)
        if reply.finish_reason is FinishReason.ERROR or reply.thinking_only:
            return reply   # nothing to keep: the caller takes the turn back
        self.session.add_reply(reply.text, reply.interrupted)
        self.last_reply = reply
        warning = self.session.context_warning() if self.more_turns else None
        if warning:
            self.renderer.warn(warning)
        return reply


def adapter_choice(text: str) -> str | None:
    """What `/adapter TEXT` and `--adapter TEXT` name: an adapter, or None for the base model."""
    return None if text.lower() in BASE_MODEL_WORDS else text


def check_adapter(name: str, loaded: Sequence[str]) -> None:
    """UsageError, listing the loaded adapters, unless `name` is one of them."""
    if name not in loaded:
        listed = ", ".join(loaded) or "none; chat loads adapters with --lora NAME=PATH"
        raise UsageError(f"no LoRA adapter named {name} is loaded (loaded: {listed})")
