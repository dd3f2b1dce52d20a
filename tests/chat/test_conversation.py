"""Conversation turns on the real engine (in process): prefix-cache reuse between turns,
context trimming against the engine's limit, and Ctrl-C (a real SIGINT) mid-reply."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.chat.conversation import Conversation
from ruvllm_cli.chat.session import ChatSession, ChatSettings


class Recorder:
    def __init__(self) -> None:
        self.warnings: list[str] = []
        self.on_first_text: Callable[[], None] | None = None

    def reply_text(self, text: str) -> None:
        if self.on_first_text is not None:
            self.on_first_text()
            self.on_first_text = None

    def reply_end(self, reply: Any, max_tokens: int) -> None:
        pass

    def warn(self, message: str) -> None:
        self.warnings.append(message)


@pytest.fixture
def make_conversation(loaded_model: Any, template: Any, tmp_path: Path) -> Iterator[Callable[..., Conversation]]:
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.loop import EngineLoop
    from ruvllm_cli.quantization import Quantization

    loops: list[Any] = []

    def make(max_model_len: int | None = None, **settings: Any) -> Conversation:
        config = EngineConfig(device="cpu", quantization=Quantization.F32, max_num_seqs=1,
                              max_model_len=max_model_len)
        engine = LLMEngine(loaded_model, config)
        loops.append(EngineLoop(engine))
        session = ChatSession(template, engine.max_model_len, model="tiny",
                              settings=ChatSettings(**{"temperature": 0.0, **settings}))
        return Conversation(session, loops[-1], Recorder(), chats_dir=tmp_path)  # type: ignore[arg-type]

    yield make
    for loop in loops:
        loop.shutdown()


def test_each_turn_reuses_the_earlier_turns_from_the_prefix_cache(make_conversation: Callable[..., Conversation]) -> None:
    conv = make_conversation(max_tokens=12)
    conv.session.system_prompt = "You are a helpful assistant who answers every question about the weather."
    first = conv.send("What is the weather like in Paris today?")
    second = conv.send("And in London?")
    assert first.stats.prompt_tokens >= 32
    assert first.stats.cached_tokens == 0
    # Every full block of the first turn's prompt is served from the cache.
    assert second.stats.cached_tokens >= first.stats.prompt_tokens // 16 * 16
    session = conv.session
    assert second.stats.prompt_tokens == len(session.template(session.template_messages(session.messages[:-1]), True))


def test_a_long_conversation_drops_its_oldest_turns_and_keeps_going(make_conversation: Callable[..., Conversation]) -> None:
    conv = make_conversation(max_model_len=128, max_tokens=16)
    conv.session.system_prompt = "Be brief."
    for i in range(8):
        reply = conv.send(f"Tell me about the weather in Paris, question {i}.")
        assert reply.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert reply.stats.prompt_tokens <= conv.session.budget == 112
    warnings = conv.renderer.warnings  # type: ignore[attr-defined]
    first_warning = next(i for i, w in enumerate(warnings) if w.startswith("the conversation uses"))
    first_drop = next(i for i, w in enumerate(warnings) if w.startswith("dropped the"))
    assert first_warning < first_drop
    assert "oldest turn" in warnings[first_drop] and "128-token context window" in warnings[first_drop]
    assert conv.session.messages[0].role == "user"
    assert conv.session.messages[-2].content == "Tell me about the weather in Paris, question 7."
    assert len(conv.session.messages) < 16


def test_sigint_mid_reply_cancels_it_and_keeps_the_partial_reply(make_conversation: Callable[..., Conversation]) -> None:
    conv = make_conversation(max_tokens=2000)
    recorder: Recorder = conv.renderer  # type: ignore[assignment]
    recorder.on_first_text = lambda: os.kill(os.getpid(), signal.SIGINT)
    handler_before = signal.getsignal(signal.SIGINT)
    reply = conv.send("Tell me a long story about a cat.")
    assert reply.finish_reason is FinishReason.CANCELLED and reply.interrupted
    assert 1 <= reply.stats.tokens < 2000
    assert conv.session.messages[-1].interrupted and conv.session.messages[-1].content == reply.text
    assert signal.getsignal(signal.SIGINT) is handler_before
    conv.session.settings = conv.session.settings.replace(max_tokens=4)
    after = conv.send("Go on.")
    assert after.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and len(conv.session.messages) == 4
