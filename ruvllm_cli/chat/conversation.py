"""One chat's turns: the session, the engine loop it talks to, and where output goes.

Each turn renders the whole conversation again; the engine's prefix cache finds the
earlier turns' blocks (same tokens, no cache salt), so only the new tokens are
prefilled and the TTFT does not grow with the length of the conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ruvllm_cli.chat.reply import Reply, stream_reply
from ruvllm_cli.chat.session import ChatSession
from ruvllm_cli.engine.request import FinishReason

if TYPE_CHECKING:
    from ruvllm_cli.chat.render import Renderer
    from ruvllm_cli.engine.loop import EngineLoop


@dataclass
class Conversation:
    session: ChatSession
    loop: "EngineLoop"
    renderer: "Renderer"
    chats_dir: Path                      # where /save writes when given no file
    last_reply: Reply | None = None

    def send(self, text: str) -> Reply:
        """Add the user's message and stream the reply to it. On failure the message
        is taken back out, so the conversation never holds an unanswered turn."""
        self.session.add_user(text)
        try:
            reply = self._respond()
        except BaseException:
            self.session.drop_last_user()
            raise
        if reply.finish_reason is FinishReason.ERROR:
            self.session.drop_last_user()
        return reply

    def retry(self) -> Reply:
        """Generate the last reply again; the old one comes back if that fails."""
        previous = self.session.pop_last_reply()
        try:
            reply = self._respond()
        except BaseException:
            self.session.messages.append(previous)
            raise
        if reply.finish_reason is FinishReason.ERROR:
            self.session.messages.append(previous)
        return reply

    def _respond(self) -> Reply:
        """Stream a reply to the last user message (trimming old turns to fit first)."""
        fit = self.session.fit_context()
        if fit.dropped_turns:
            turns = "turn" if fit.dropped_turns == 1 else "turns"
            self.renderer.warn(f"dropped the {fit.dropped_turns} oldest {turns} to fit the "
                               f"{self.session.context_limit}-token context window")
        reply = stream_reply(self.loop, fit.prompt_ids, self.session.sampling_params(),
                             self.renderer.reply_text)
        self.renderer.reply_end(reply, self.session.settings.max_tokens)
        if reply.finish_reason is FinishReason.ERROR:
            return reply
        self.session.add_reply(reply.text, reply.interrupted)
        self.last_reply = reply
        warning = self.session.context_warning()
        if warning:
            self.renderer.warn(warning)
        return reply
