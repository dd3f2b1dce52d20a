"""A reasoning model in `ruvllm chat`: its reasoning is shown apart (dim in the REPL, on
stderr when piped) and not kept in the conversation; --no-think turns it off where the
template takes enable_thinking; a JSON reply's constraint waits for the reasoning's end."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ruvllm_cli.chat.conversation import Conversation
from ruvllm_cli.chat.session import ChatSession, ChatTemplate
from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.reasoning import FORMATS, model_reasoning, split_reasoning
from ruvllm_cli.engine.request import FinishReason, RequestTimings

Run = Callable[..., subprocess.CompletedProcess[str]]
PIECES = ["\nIt is ", "sunny.\n</thi", "nk>\n\nSunny", " today."]


@dataclass
class Recorder:
    reasoning: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def reply_text(self, text: str) -> None:
        self.text.append(text)

    def reply_reasoning(self, text: str) -> None:
        self.reasoning.append(text)

    def reply_end(self, reply: Any, max_tokens: int) -> None:
        pass

    def warn(self, message: str) -> None:
        pass


@dataclass
class ScriptedLoop:
    """Streams PIECES as the reply, recording what each request asked."""

    asked: list[tuple[list[int], Any]] = field(default_factory=list)

    def submit(self, prompt: list[int], params: Any, adapter: str | None = None) -> list[RequestOutput]:
        self.asked.append((prompt, params))
        timings = RequestTimings(arrival=1.0, first_token=1.1, finished=1.4, token_times=[1.1, 1.2, 1.3, 1.4])
        outputs = [RequestOutput("r", [i], piece, timings=timings) for i, piece in enumerate(PIECES)]
        outputs[-1].finished, outputs[-1].finish_reason = True, FinishReason.STOP
        outputs[-1].num_output_tokens = len(PIECES)
        return outputs


@pytest.fixture(scope="module")
def reasoning_tokenizer(make_tiny_model) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model(reasoning="opens"))


def test_the_reasoning_is_shown_apart_and_not_kept(reasoning_tokenizer, tmp_path) -> None:
    session = ChatSession(ChatTemplate(reasoning_tokenizer), 4096, model="thinker")
    renderer, loop = Recorder(), ScriptedLoop()
    conversation = Conversation(session, loop, renderer, chats_dir=tmp_path,   # type: ignore[arg-type]
                                reasoning=model_reasoning(reasoning_tokenizer))
    reply = conversation.send("Weather?")
    assert "".join(renderer.reasoning) == reply.reasoning == "It is sunny."
    assert "".join(renderer.text) == reply.text == "Sunny today."
    assert session.messages[-1].content == "Sunny today."          # the answer alone is kept
    _, params = loop.asked[0]
    assert {"<think>", "</think>"} <= set(params.kept_special_tokens) and params.reasoning_block is None
    conversation.send("And tomorrow?")
    prompt, _ = loop.asked[1]
    assert "sunny." not in reasoning_tokenizer.decode(prompt)       # earlier reasoning is not sent again


def test_a_reply_that_ends_while_thinking_keeps_nothing(reasoning_tokenizer, tmp_path) -> None:
    """Stopped, cut by the limit or ended by the model before its answer: an empty turn would
    go into every later prompt, so the user's message is taken back as after an error."""
    session = ChatSession(ChatTemplate(reasoning_tokenizer), 4096, model="thinker")
    loop, renderer = ScriptedLoop(), Recorder()
    conversation = Conversation(session, loop, renderer, chats_dir=tmp_path,   # type: ignore[arg-type]
                                reasoning=model_reasoning(reasoning_tokenizer))
    PIECES[:] = ["\nstill ", "thinking"]
    try:
        reply = conversation.send("Weather?")
    finally:
        PIECES[:] = ["\nIt is ", "sunny.\n</thi", "nk>\n\nSunny", " today."]
    assert reply.thinking_only and reply.reasoning == "still thinking" and reply.text == ""
    assert session.messages == []


def test_a_json_reply_waits_for_the_end_of_the_reasoning(reasoning_tokenizer, tmp_path) -> None:
    from ruvllm_cli.engine.grammar import GrammarSpec

    session = ChatSession(ChatTemplate(reasoning_tokenizer), 4096, model="thinker",
                          structured=GrammarSpec.json_object())
    loop = ScriptedLoop()
    conversation = Conversation(session, loop, Recorder(), chats_dir=tmp_path,   # type: ignore[arg-type]
                                reasoning=model_reasoning(reasoning_tokenizer))
    conversation.send("Weather?")
    block = loop.asked[0][1].reasoning_block   # the template opened the block: the constraint waits for its end
    assert block.inside and block.end_id == reasoning_tokenizer.convert_tokens_to_ids("</think>")


def raw_reply(model: Path, message: str, max_tokens: int, **template: Any) -> str:
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.engine.loader import load_model
    from ruvllm_cli.engine.sampling import SamplingParams
    from ruvllm_cli.quantization import Quantization

    engine = LLMEngine(load_model(model, "cpu", Quantization.F32), EngineConfig(device="cpu"))
    ids = ChatTemplate(engine.tokenizer, template or None)([{"role": "user", "content": message}], True)
    [completion] = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                         kept_special_tokens=("<think>", "</think>")))
    return completion.text


def test_piped_the_answer_alone_is_on_stdout(ruvllm: Run, make_tiny_model) -> None:
    model = make_tiny_model(reasoning="opens")
    raw = raw_reply(model, "hello", 12)
    expected = split_reasoning(FORMATS["think"], raw, in_reasoning=True)
    # the template opened the block, and 12 greedy tokens do not close it: reasoning, no answer
    assert expected.reasoning and not expected.content
    result = ruvllm("chat", str(model), "-q", "none", "-t", "0", "--max-tokens", "12", input="hello\n")
    assert result.returncode == 1 and result.stdout == ""   # nothing to print, and a script must know
    assert expected.reasoning in result.stderr and "no answer: the reply ended while the model was thinking " \
        "(it reached the 12-token limit (--max-tokens raises it))" in " ".join(result.stderr.split())
    hidden = ruvllm("chat", str(model), "-q", "none", "-t", "0", "--max-tokens", "12", "--hide-thinking",
                    input="hello\n")
    assert hidden.stdout == "" and expected.reasoning not in hidden.stderr
    # --no-think: the template closes an empty block, and the reply is all answer
    plain = raw_reply(model, "hello", 12, enable_thinking=False)
    off = ruvllm("chat", str(model), "-q", "none", "-t", "0", "--max-tokens", "12", "--no-think", input="hello\n")
    assert off.returncode == 0, off.stderr
    assert off.stdout == split_reasoning(FORMATS["think"], plain, in_reasoning=False).content + "\n"
    assert "changes nothing" not in off.stderr


def test_think_on_a_template_without_the_switch_says_it_changes_nothing(ruvllm: Run, tiny_model_dir) -> None:
    result = ruvllm("chat", str(tiny_model_dir), "-q", "none", "--max-tokens", "2", "--no-think", input="hi\n")
    assert result.returncode == 0, result.stderr
    assert "--no-think changes nothing: this model's chat template has no enable_thinking switch" in \
        " ".join(result.stderr.split())


def test_the_terminal_shows_the_reasoning_dim_before_the_answer() -> None:
    import io

    from rich.console import Console

    from ruvllm_cli.chat.render import TerminalRenderer
    from ruvllm_cli.chat.reply import Reply, ReplyStats

    reply = Reply("Sunny.", FinishReason.STOP, ReplyStats(3, 5, 0, 0.1, 20.0, 0.2), reasoning="It is sunny.")
    for show in (True, False):
        screen = io.StringIO()
        renderer = TerminalRenderer(Console(file=screen, force_terminal=True, color_system="standard", width=80),
                                    show_reasoning=show)
        renderer.reply_reasoning("It is ")
        renderer.reply_reasoning("sunny.")
        renderer.reply_text("Sunny.")
        renderer.reply_end(reply, 64)
        shown = screen.getvalue()
        if show:
            assert shown.index("Thinking…") < shown.index("It is ") < shown.index("done thinking") \
                < shown.index("Sunny.")
            assert "\x1b[2;3m" in shown   # dim italic
        else:
            assert "Thinking" not in shown and "It is" not in shown and "Sunny." in shown
    cut = Reply("", FinishReason.CANCELLED, ReplyStats(3, 5, 0, 0.1, 20.0, 0.2), reasoning="It is")
    screen = io.StringIO()
    renderer = TerminalRenderer(Console(file=screen, force_terminal=False, width=200))
    renderer.reply_reasoning("It is")
    renderer.reply_end(cut, 64)
    shown = screen.getvalue()
    assert "done thinking" not in shown and "Interrupted" not in shown
    assert "no answer: the reply ended while the model was thinking (it was stopped)" in shown


def test_slash_think_switches_the_templates_thinking(reasoning_tokenizer, tokenizer, tmp_path) -> None:
    from ruvllm_cli.chat.commands import run_command
    from ruvllm_cli.errors import UsageError

    @dataclass
    class Lines(Recorder):
        lines: list[str] = field(default_factory=list)

        def info(self, message: str) -> None:
            self.lines.append(message)

    session = ChatSession(ChatTemplate(reasoning_tokenizer), 4096, model="thinker")
    loop, renderer = ScriptedLoop(), Lines()
    conversation = Conversation(session, loop, renderer, chats_dir=tmp_path,   # type: ignore[arg-type]
                                reasoning=model_reasoning(reasoning_tokenizer))
    run_command(conversation, "/think")
    run_command(conversation, "/think off")
    conversation.send("Weather?")
    assert reasoning_tokenizer.decode(loop.asked[-1][0]).endswith("<think>\n\n</think>\n\n")   # an empty block
    run_command(conversation, "/think on")
    run_command(conversation, "/think")
    assert renderer.lines == ["Thinking: as the chat template has it.", "Thinking off: the next replies answer at once.",
                              "Thinking on: the next replies reason first.", "Thinking: on."]
    with pytest.raises(UsageError):
        run_command(conversation, "/think maybe")
    plain = Conversation(ChatSession(ChatTemplate(tokenizer), 4096, model="tiny"), loop, renderer,  # type: ignore[arg-type]
                         chats_dir=tmp_path)
    with pytest.raises(UsageError, match="no enable_thinking switch"):
        run_command(plain, "/think off")
