"""Slash commands and conversation turns without a terminal: a recording renderer and a
scripted engine loop stand in for the screen and the model."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document

from ruvllm_cli.engine.request import FinishReason
from ruvllm_cli.chat.commands import COMMANDS, Action, completions, run_command
from ruvllm_cli.chat.conversation import Conversation
from ruvllm_cli.chat.render import format_stats_line
from ruvllm_cli.chat.reply import ReplyStats
from ruvllm_cli.chat.repl import SlashCompleter, block_text
from ruvllm_cli.chat.session import ChatSession, ChatSettings
from ruvllm_cli.engine.outputs import RequestOutput
from ruvllm_cli.engine.request import RequestTimings
from ruvllm_cli.errors import RuvllmError, UsageError


@dataclass
class RecordingRenderer:
    lines: list[str] = field(default_factory=list)
    streamed: list[str] = field(default_factory=list)

    def reply_text(self, text: str) -> None:
        self.streamed.append(text)

    def reply_end(self, reply: Any, max_tokens: int) -> None:
        self.lines.append(f"<end {reply.finish_reason.value}>")

    def rows(self, rows: list[tuple[str, str]]) -> None:
        self.lines += [f"{key}: {value}" for key, value in rows]

    def info(self, message: str) -> None:
        self.lines.append(message)

    def warn(self, message: str) -> None:
        self.lines.append(f"Warning: {message}")

    def error(self, message: str, hint: str | None = None) -> None:
        self.lines.append(f"Error: {message}")


class ScriptedStream:
    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    def __iter__(self) -> Iterator[RequestOutput]:
        return iter(self.outputs)

    def cancel(self) -> None:
        pass


@dataclass
class ScriptedLoop:
    """Replies "reply 1", "reply 2", ... as two text pieces each, with engine-like timings."""

    prompts: list[list[int]] = field(default_factory=list)
    adapters: list[str | None] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.STOP

    def submit(self, prompt: list[int], params: Any, adapter: str | None = None) -> ScriptedStream:
        self.prompts.append(prompt)
        self.adapters.append(adapter)
        n = len(self.prompts)
        timings = RequestTimings(arrival=10.0, first_token=10.05, finished=10.25, token_times=[10.05, 10.15, 10.25])
        first = RequestOutput("r", [5], "reply ", timings=timings)
        last = RequestOutput("r", [6], str(n), finished=True, finish_reason=self.finish_reason,
                             num_prompt_tokens=len(prompt), num_output_tokens=3, timings=timings,
                             error="boom" if self.finish_reason is FinishReason.ERROR else None)
        return ScriptedStream([first, last])


@pytest.fixture
def conv(template: Any, tmp_path: Path) -> Conversation:
    session = ChatSession(template, 4096, model="tiny")
    return Conversation(session, ScriptedLoop(), RecordingRenderer(), chats_dir=tmp_path / "chats")  # type: ignore[arg-type]


def lines(conv: Conversation) -> list[str]:
    return conv.renderer.lines  # type: ignore[attr-defined]


# ---- turns ----------------------------------------------------------------------------------

def test_send_streams_the_reply_and_keeps_it(conv: Conversation) -> None:
    reply = conv.send("hello")
    assert conv.renderer.streamed == ["reply ", "1"]  # type: ignore[attr-defined]
    assert reply.text == "reply 1" and reply.finish_reason is FinishReason.STOP
    assert [m.to_dict() for m in conv.session.messages] == [{"role": "user", "content": "hello"},
                                                            {"role": "assistant", "content": "reply 1"}]
    assert conv.loop.prompts[0] == conv.session.template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "hello"}], True)


def test_stats_come_from_the_engine_timings(conv: Conversation) -> None:
    stats = conv.send("hello").stats
    assert stats.tokens == 3 and stats.ttft_s == pytest.approx(0.05)
    assert stats.decode_tok_s == pytest.approx(10.0) and stats.total_s == pytest.approx(0.25)
    assert format_stats_line(stats) == "3 tokens · TTFT 50 ms · 10.0 tok/s"
    assert format_stats_line(ReplyStats(1, 5, 0, 1.5, None, 1.5)) == "1 token · TTFT 1.50 s · n/a tok/s"


def test_the_second_turn_renders_the_whole_conversation(conv: Conversation) -> None:
    conv.send("hello")
    conv.send("again")
    first, second = conv.loop.prompts  # type: ignore[attr-defined]
    assert second[:len(first)] == first


def test_retry_replaces_the_last_reply(conv: Conversation) -> None:
    conv.send("hello")
    run_command(conv, "/retry")
    assert [m.content for m in conv.session.messages] == ["hello", "reply 2"]
    assert conv.loop.prompts[0] == conv.loop.prompts[1]  # type: ignore[attr-defined]


def test_retry_without_a_reply_is_an_error(conv: Conversation) -> None:
    with pytest.raises(UsageError, match="there is no reply to retry yet"):
        run_command(conv, "/retry")


def test_a_loaded_chat_ending_in_a_question_says_so_and_retry_answers_it(conv: Conversation,
                                                                          tmp_path: Path) -> None:
    """A chat saved or edited to end in the user's message: /retry said "no reply to
    retry yet" and left no way to answer it but a second user turn."""
    path = tmp_path / "asked.json"
    path.write_text(json.dumps({"format": "ruvllm-chat", "model": "tiny", "messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "and then?"}]}))
    run_command(conv, f"/load {path}")
    assert lines(conv)[-2:] == [f"Loaded 3 messages from {path}", "Its last message has no reply yet: /retry answers it."]
    run_command(conv, "/retry")
    assert [m.content for m in conv.session.messages] == ["hello", "hi", "and then?", "reply 1"]
    assert conv.loop.prompts[0] == conv.session.template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
         {"role": "user", "content": "and then?"}], True)
    conv.loop.finish_reason = FinishReason.ERROR  # type: ignore[attr-defined]
    del conv.session.messages[-1]
    conv.retry()                                # a failed first answer leaves the question as it was
    assert [m.content for m in conv.session.messages] == ["hello", "hi", "and then?"]


def test_a_failed_reply_takes_the_message_back(conv: Conversation) -> None:
    conv.send("hello")
    conv.loop.finish_reason = FinishReason.ERROR  # type: ignore[attr-defined]
    assert conv.send("again").finish_reason is FinishReason.ERROR
    assert [m.content for m in conv.session.messages] == ["hello", "reply 1"]
    conv.retry()
    assert [m.content for m in conv.session.messages] == ["hello", "reply 1"]


def test_a_cancelled_reply_stays_marked_interrupted(conv: Conversation) -> None:
    conv.loop.finish_reason = FinishReason.CANCELLED  # type: ignore[attr-defined]
    reply = conv.send("hello")
    assert reply.interrupted
    assert conv.session.messages[-1].to_dict() == {"role": "assistant", "content": "reply 1", "interrupted": True}
    run_command(conv, "/history")
    assert lines(conv)[-1] == "Assistant: reply 1 [interrupted]"


# ---- commands -------------------------------------------------------------------------------

def test_temp_out_of_range_is_rejected_and_nothing_changes(conv: Conversation) -> None:
    with pytest.raises(UsageError, match=r"^temperature must be between 0 and 2 \(got 3.0\)$"):
        run_command(conv, "/temp 3")
    run_command(conv, "/temp")
    assert lines(conv)[-1] == "temperature = 0.7"
    run_command(conv, "/temp 1.5")
    assert conv.session.settings.temperature == 1.5 and lines(conv)[-1] == "temperature = 1.5"


def test_max_and_set(conv: Conversation) -> None:
    run_command(conv, "/max 64")
    run_command(conv, "/set top-p 0.9")
    run_command(conv, "/set seed 42")
    run_command(conv, "/set repetition_penalty 1.2")
    run_command(conv, "/set min_p 0.05")
    run_command(conv, "/set presence_penalty -0.5")
    run_command(conv, "/set frequency_penalty 0.5")
    run_command(conv, "/set top_k 40")
    assert conv.session.settings == ChatSettings(max_tokens=64, top_p=0.9, seed=42, repetition_penalty=1.2,
                                                 min_p=0.05, presence_penalty=-0.5, frequency_penalty=0.5,
                                                 top_k=40)
    for bad, message in [("/max 0", "max_tokens must be at least 1"), ("/max lots", "max_tokens must be a whole number"),
                         ("/set top_p 2", "top_p must be in"), ("/set presence_penalty 3", "presence_penalty must be"),
                         ("/set top_k -1", "top_k must be 0"), ("/set warmth 1", "unknown parameter 'warmth'")]:
        with pytest.raises(UsageError, match=message):
            run_command(conv, bad)
    run_command(conv, "/set")
    assert "top_p: 0.9" in lines(conv) and "seed: 42" in lines(conv)


def test_max_beyond_the_context_is_refused(conv: Conversation) -> None:
    """Issue 23, item 8: /max 100000 was accepted with a 4,096-token context."""
    run_command(conv, "/max 64")
    for bad in ("/max 100000", "/set max_tokens 4097"):
        with pytest.raises(UsageError) as caught:
            run_command(conv, bad)
        assert caught.value.message.endswith("is beyond the model's 4096-token context")
        assert caught.value.hint == ("a reply ends where the context does: give at most 4096 (/tokens shows how "
                                     "much the conversation takes)")
    assert conv.session.settings.max_tokens == 64
    run_command(conv, "/max 4096")
    assert conv.session.settings.max_tokens == 4096


def test_system_shows_sets_and_clears(conv: Conversation) -> None:
    run_command(conv, "/system")
    assert lines(conv)[-1].startswith("No system prompt.")
    run_command(conv, "/system You are a pirate.")
    assert conv.session.system_prompt == "You are a pirate."
    run_command(conv, "/system")
    assert lines(conv)[-1] == "System prompt: You are a pirate."
    run_command(conv, "/system --clear")
    assert conv.session.system_prompt is None


def test_clear_keeps_system_prompt_and_settings(conv: Conversation) -> None:
    run_command(conv, "/system Be brief.")
    run_command(conv, "/temp 0.3")
    conv.send("hello")
    run_command(conv, "/clear")
    assert conv.session.messages == [] and conv.session.system_prompt == "Be brief."
    assert conv.session.settings.temperature == 0.3


def test_tokens_reports_the_real_count_against_the_context(conv: Conversation) -> None:
    conv.send("hello")
    run_command(conv, "/tokens")
    count = conv.session.count_tokens()
    assert count > 0
    assert lines(conv)[-1] == (f"{count} tokens in the conversation of a 4096-token context ({100 * count / 4096:.0f}%); "
                               "512 kept free for the next reply")


def test_stats_before_and_after_a_reply(conv: Conversation) -> None:
    run_command(conv, "/stats")
    assert lines(conv)[-1] == "No reply yet."
    conv.send("hello")
    run_command(conv, "/stats")
    assert lines(conv)[-5:] == ["tokens: 3 (stop)", "TTFT: 50 ms", "decode: 10.0 tok/s", "total: 250 ms",
                                f"prompt: {len(conv.loop.prompts[0])} tokens, 0 from the prefix cache"]  # type: ignore[attr-defined]


def test_save_and_load_round_trip_with_default_file(conv: Conversation, tmp_path: Path) -> None:
    run_command(conv, "/system Be brief.")
    run_command(conv, "/temp 0.3")
    conv.send("hello")
    run_command(conv, "/save")
    saved = list((tmp_path / "chats").glob("chat-*.json"))
    assert len(saved) == 1 and lines(conv)[-1] == f"Saved 2 messages to {saved[0]}"
    run_command(conv, "/clear")
    run_command(conv, "/temp 1")
    run_command(conv, "/system --clear")
    run_command(conv, "/load")
    assert lines(conv)[-1] == f"Loaded 2 messages from {saved[0]}"
    assert conv.session.settings.temperature == 0.3 and conv.session.system_prompt == "Be brief."
    assert [m.content for m in conv.session.messages] == ["hello", "reply 1"]


def test_saves_within_one_second_keep_every_file(conv: Conversation, tmp_path: Path, monkeypatch) -> None:
    """The default name has the time to the second: a second save then (this chat's or
    another process's) gets a count, never overwriting the first."""
    import datetime as dt

    from ruvllm_cli.chat import commands

    frozen = dt.datetime(2026, 11, 28, 2, 30, 0)
    monkeypatch.setattr(commands, "datetime", type("Frozen", (), {"now": staticmethod(lambda: frozen)}))
    conv.send("hello")
    for _ in range(3):
        run_command(conv, "/save")
    names = sorted(p.name for p in (tmp_path / "chats").glob("chat-*.json"))
    assert names == ["chat-20261128-023000-2.json", "chat-20261128-023000-3.json", "chat-20261128-023000.json"]


def test_load_warns_about_another_model_and_errors_clearly(conv: Conversation, tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "ruvllm-chat", "model": "qwen", "messages": []}))
    run_command(conv, f"/load {path}")
    assert lines(conv)[-1] == "Warning: it was saved with qwen; replies now come from tiny"
    with pytest.raises(UsageError, match="no saved chats in"):
        run_command(conv, "/load")
    with pytest.raises(RuvllmError, match="no chat file at"):
        run_command(conv, f"/load {tmp_path / 'missing.json'}")


@pytest.mark.parametrize("fields, message", [
    ({"parameters": "x"}, "parameters must be an object of name: value"),
    ({"version": 999}, "is a chat file of version 999; this ruvllm reads up to 1"),
    ({"version": "1"}, "is a chat file of version '1'"),
])
def test_a_saved_chat_it_cannot_read_is_one_clear_error(conv: Conversation, tmp_path: Path, fields, message) -> None:
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"format": "ruvllm-chat", "version": 1, "model": "tiny", "messages": [], **fields}))
    with pytest.raises(RuvllmError, match=message):
        run_command(conv, f"/load {path}")


@pytest.fixture
def lora_conv(conv: Conversation) -> Conversation:
    conv.adapters = ("sql", "chat")
    return conv


def test_adapter_switches_the_adapter_of_the_next_replies(lora_conv: Conversation) -> None:
    conv = lora_conv
    run_command(conv, "/adapter")
    assert lines(conv)[-1] == ("Replies come from the base model; loaded: sql, chat (/adapter NAME switches, "
                               "/adapter base goes back).")
    conv.send("one")
    run_command(conv, "/adapter sql")
    assert lines(conv)[-1] == "Replies now come from adapter sql."
    conv.send("two")
    run_command(conv, "/retry")
    run_command(conv, "/adapter")
    assert lines(conv)[-1].startswith("Replies come from adapter sql; loaded: sql, chat")
    run_command(conv, "/adapter chat")
    conv.send("three")
    run_command(conv, "/adapter base")
    assert lines(conv)[-1] == "Replies now come from the base model."
    conv.send("four")
    run_command(conv, "/adapter chat")
    run_command(conv, "/adapter NONE")
    conv.send("five")
    assert conv.loop.adapters == [None, "sql", "sql", "chat", None, None]  # type: ignore[attr-defined]


def test_an_unknown_adapter_is_one_line_naming_the_loaded_ones(lora_conv: Conversation) -> None:
    run_command(lora_conv, "/adapter sql")
    with pytest.raises(UsageError) as caught:
        run_command(lora_conv, "/adapter sq")
    assert caught.value.message == "no LoRA adapter named sq is loaded (loaded: sql, chat)"
    assert caught.value.hint is None
    assert lora_conv.session.adapter == "sql"


def test_adapter_without_any_loaded(conv: Conversation) -> None:
    run_command(conv, "/adapter")
    assert lines(conv)[-1] == ("Replies come from the base model; no LoRA adapter is loaded (start chat with "
                               "--lora NAME=PATH).")
    with pytest.raises(UsageError, match=r"^no LoRA adapter named sql is loaded \(loaded: none; chat loads "
                                         r"adapters with --lora NAME=PATH\)$"):
        run_command(conv, "/adapter sql")
    run_command(conv, "/adapter base")
    assert conv.session.adapter is None


def test_save_keeps_the_adapter_and_load_restores_it(lora_conv: Conversation, tmp_path: Path) -> None:
    conv = lora_conv
    run_command(conv, f"/save {tmp_path / 'base.json'}")
    run_command(conv, "/adapter chat")
    run_command(conv, f"/save {tmp_path / 'chat.json'}")
    assert json.loads((tmp_path / "base.json").read_text())["adapter"] is None
    assert json.loads((tmp_path / "chat.json").read_text())["adapter"] == "chat"
    run_command(conv, f"/load {tmp_path / 'base.json'}")
    assert conv.session.adapter is None and lines(conv)[-1] == "Replies now come from the base model."
    run_command(conv, f"/load {tmp_path / 'chat.json'}")
    assert conv.session.adapter == "chat" and lines(conv)[-1] == "Replies now come from adapter chat."
    run_command(conv, f"/load {tmp_path / 'chat.json'}")
    assert lines(conv)[-1] == f"Loaded 0 messages from {tmp_path / 'chat.json'}"  # no change, no notice
    conv.send("hello")
    assert conv.loop.adapters == ["chat"]  # type: ignore[attr-defined]


def test_loading_a_chat_whose_adapter_is_not_loaded_warns_and_uses_the_base_model(lora_conv: Conversation,
                                                                                   tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"format": "ruvllm-chat", "model": "tiny", "adapter": "poetry", "messages": []}))
    run_command(lora_conv, "/adapter sql")
    run_command(lora_conv, f"/load {path}")
    assert lines(lora_conv)[-1] == ("Warning: it was saved with LoRA adapter poetry, which is not loaded; "
                                    "replies now come from the base model")
    assert lora_conv.session.adapter is None


@pytest.mark.parametrize("line", ["/quit", "/exit", "/q", "/QUIT"])
def test_quit_commands(conv: Conversation, line: str) -> None:
    assert run_command(conv, line) is Action.QUIT


def test_unknown_command_suggests_the_nearest(conv: Conversation) -> None:
    with pytest.raises(UsageError, match=r"^unknown command /histroy$") as error:
        run_command(conv, "/histroy")
    assert error.value.hint == "did you mean /history? /help lists the commands"


def test_help_lists_every_command(conv: Conversation) -> None:
    run_command(conv, "/help")
    text = "\n".join(lines(conv))
    for command in COMMANDS:
        assert f"/{command.name}" in text
    assert "/quit | /exit | /q" in text


# ---- completion and multi-line input ----------------------------------------------------------

def test_completion_of_commands_and_parameters() -> None:
    assert completions("/he") == ["/help"]
    assert completions("/s") == ["/system", "/set", "/save", "/stats"]
    assert completions("/set top") == ["top_p", "top_k"]
    assert completions("hello /he") == [] and completions("/temp 0") == []
    found = list(SlashCompleter().get_completions(Document("/set rep"), CompleteEvent(completion_requested=True)))
    assert [(c.text, c.start_position) for c in found] == [("repetition_penalty", -3)]


def test_completion_of_slash_command_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 23, item 2: /system's flag, /save and /load's files, the saved chats' names."""
    chats = tmp_path / "chats"
    chats.mkdir()
    for age, name in enumerate(["chat-20260101-090000.json", "chat-20260102-090000.json"]):
        (chats / name).write_text("{}")
        os.utime(chats / name, (1000 - age, 1000 - age))     # the second is the older
    work = tmp_path / "work"
    (work / "notes").mkdir(parents=True)
    (work / "my-chat.json").write_text("{}")
    (work / ".hidden").write_text("")
    monkeypatch.chdir(work)
    assert completions("/system --c") == ["--clear"] and completions("/system ") == []
    assert completions("/save ") == ["my-chat.json", "notes/"]
    assert completions("/save no") == ["notes/"] and completions("/save .h") == [".hidden"]
    assert completions("/load ", chats) == ["chat-20260101-090000.json", "chat-20260102-090000.json",
                                             "my-chat.json", "notes/"]
    assert completions("/load chat-202601", chats) == ["chat-20260101-090000.json", "chat-20260102-090000.json"]
    assert completions(f"/load {chats}/chat-20260102", chats) == [f"{chats}/chat-20260102-090000.json"]
    assert completions("/load ", None) == ["my-chat.json", "notes/"]
    found = list(SlashCompleter(chats).get_completions(Document("/load chat-20260102"),
                                                       CompleteEvent(completion_requested=True)))
    assert [(c.text, c.start_position) for c in found] == [("chat-20260102-090000.json", -13)]
    # A path with a space: it had stopped completing at the space (the last word alone was matched)
    (work / "my notes").mkdir()
    (work / "my notes" / "day one.json").write_text("{}")
    assert completions("/load my notes/da", chats) == ["my notes/day one.json"]
    found = list(SlashCompleter(chats).get_completions(Document("/save my no"), CompleteEvent()))
    assert [(c.text, c.start_position) for c in found] == [("my notes/", -5)]
    assert completions("/set temperature 0.") == []   # other commands still complete one word


def test_load_finds_a_saved_chat_by_its_name(conv: Conversation) -> None:
    run_command(conv, "/system terse")
    run_command(conv, "/save")
    saved = next(conv.chats_dir.glob("chat-*.json"))
    run_command(conv, "/system --clear")
    run_command(conv, f"/load {saved.name}")
    assert conv.session.system_prompt == "terse"
    assert lines(conv)[-1] == f"Loaded 0 messages from {saved}"


def test_completion_of_adapter_names() -> None:
    assert completions("/ad") == ["/adapter"]
    assert completions("/adapter ", adapters=("sql", "chat")) == ["base", "sql", "chat"]
    assert completions("/adapter s", adapters=("sql", "chat")) == ["sql"]
    assert completions("/adapter ") == ["base"]
    found = list(SlashCompleter(None, ("sql", "chat")).get_completions(Document("/adapter ch"),
                                                                       CompleteEvent(completion_requested=True)))
    assert [(c.text, c.start_position) for c in found] == [("chat", -2)]


def test_block_text_drops_markers_and_outer_blank_lines() -> None:
    assert block_text("", ["line one", "line two", ""]) == "line one\nline two"
    assert block_text("first", ["  indented"]) == "first\n  indented"


# ---- defaults and the history file ------------------------------------------------------------

def test_sampling_defaults_are_options_then_registry_then_builtin() -> None:
    from ruvllm_cli.cli.chat import resolve_settings

    none_given = {"max_tokens": 512, "temperature": None, "top_p": None, "seed": None}
    recommended = {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert resolve_settings(none_given, None) == ChatSettings()
    assert resolve_settings(none_given, recommended) == ChatSettings(temperature=0.3, top_p=0.8, top_k=20,
                                                                     repetition_penalty=1.05)
    given = {"max_tokens": 64, "temperature": 0.0, "top_p": 0.95, "seed": 3}
    assert resolve_settings(given, recommended) == ChatSettings(temperature=0.0, top_p=0.95, top_k=20,
                                                                repetition_penalty=1.05, max_tokens=64, seed=3)


def test_an_unwritable_history_file_falls_back_to_memory(tmp_path: Path) -> None:
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    from ruvllm_cli.chat.repl import open_history

    history, problem = open_history(tmp_path / "cache" / "chat_history")
    assert isinstance(history, FileHistory) and problem is None
    assert (tmp_path / "cache" / "chat_history").is_file()
    (tmp_path / "file").write_text("")
    history, problem = open_history(tmp_path / "file" / "chat_history")
    assert isinstance(history, InMemoryHistory)
    assert problem is not None and problem.startswith(f"cannot write the history file {tmp_path / 'file'}")


def test_save_never_replaces_what_is_not_a_regular_file(conv: Conversation, tmp_path: Path) -> None:
    """/save /dev/null as root had replaced the device with a file; a symlink is written
    through; a directory takes a new chat name; a missing directory is an error."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UsageError, match="not a regular file"):
        run_command(conv, f"/save {fifo}")
    assert fifo.is_fifo()
    target = tmp_path / "real.json"
    target.write_text("{}")
    (tmp_path / "link.json").symlink_to(target)
    run_command(conv, f"/save {tmp_path / 'link.json'}")
    assert (tmp_path / "link.json").is_symlink() and json.loads(target.read_text())["format"] == "ruvllm-chat"
    (tmp_path / "dir").mkdir()
    run_command(conv, f"/save {tmp_path / 'dir'}")
    assert [p.name.startswith("chat-") for p in (tmp_path / "dir").iterdir()] == [True]
    with pytest.raises(UsageError, match="no directory"):
        run_command(conv, f"/save {tmp_path / 'missing' / 'x.json'}")
    assert not (tmp_path / "missing").exists()
    with pytest.raises(UsageError, match="no directory"):   # a directory meant: it had written the file x.json
        run_command(conv, f"/save {tmp_path / 'x.json'}/")
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("line", ["/load " + "x" * 300, "/save ~no_such_user_ruvllm/x.json",
                                  "/load ~no_such_user_ruvllm/x.json"])
def test_a_path_the_system_refuses_is_a_usage_error(conv: Conversation, line: str) -> None:
    """A name too long (ENAMETOOLONG from exists()) or a ~user with no home used to end
    the REPL with the conversation in it."""
    with pytest.raises(RuvllmError):
        run_command(conv, line)


@pytest.mark.parametrize("fields, message", [
    ({"messages": "notalist"}, "messages must be a list"),
    ({"parameters": {"max_tokens": 99999}}, "max_tokens 99999 is beyond the model's 4096-token context"),
])
def test_a_loaded_chat_is_checked_as_the_commands_check(conv: Conversation, tmp_path: Path, fields, message) -> None:
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"format": "ruvllm-chat", "version": 1, "model": "tiny", **fields}))
    with pytest.raises(RuvllmError, match=message):
        run_command(conv, f"/load {path}")


def test_control_characters_never_reach_the_terminal() -> None:
    from ruvllm_cli.chat.render import terminal_safe

    assert terminal_safe("a\x1b]52;c;aGk=\x07b\tc\r\nd\x9b31m\x00") == "a\\x1b]52;c;aGk=\\x07b\tc\nd\\x9b31m\\x00"
    assert terminal_safe("中文 é ✓") == "中文 é ✓"


# ---- a helper's pass over the REPL (each of these had ended the chat or left it broken) ----

def test_load_refuses_what_is_not_a_regular_file_or_not_unicode(conv: Conversation, tmp_path: Path) -> None:
    """/load /dev/zero read until the kernel killed the chat; a FIFO blocked it; a file's
    \\ud800 escape loaded, failed every message, and /save then ended the chat."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, message in ((Path("/dev/zero"), "is not a regular file"), (fifo, "is not a regular file"),
                          (tmp_path, "is a directory, not a chat file")):
        with pytest.raises(RuvllmError, match=message):
            run_command(conv, f"/load {path}")
    lone = tmp_path / "surrogate.json"
    lone.write_text('{"format": "ruvllm-chat", "version": 1, "model": "tiny", "messages": '
                    '[{"role": "user", "content": "lone \\ud800 surrogate"}]}')
    with pytest.raises(RuvllmError, match="not Unicode"):
        run_command(conv, f"/load {lone}")
    assert conv.session.messages == []


def test_text_that_is_not_utf8_or_a_nul_in_a_command_is_one_error() -> None:
    """A latin-1 terminal's "é" arrives as a surrogate escape: every message failed in the
    tokenizer and /save ended the chat; a NUL in a pasted path raised ValueError."""
    from ruvllm_cli.chat.repl import ChatRepl

    class Conversation_:
        renderer = RecordingRenderer()

    repl = ChatRepl.__new__(ChatRepl)
    repl.conversation = Conversation_()   # type: ignore[assignment]
    assert repl.handle("/system caf\udce9 prompt") is Action.CONTINUE
    assert repl.handle("caf\udce9", command=False) is Action.CONTINUE
    assert repl.handle("/save sv/a\0b.json") is Action.CONTINUE
    assert Conversation_.renderer.lines == ["Error: the input is not UTF-8 text"] * 2 + [
        "Error: a command must not contain a NUL character"]


def test_a_history_file_that_is_a_directory_falls_back_to_memory(tmp_path: Path) -> None:
    """touch() succeeds on a directory: prompt-toolkit then printed a traceback and
    "Press ENTER to continue..." at every prompt."""
    from prompt_toolkit.history import InMemoryHistory

    from ruvllm_cli.chat.repl import open_history

    (tmp_path / "chat_history").mkdir()
    history, problem = open_history(tmp_path / "chat_history")
    assert isinstance(history, InMemoryHistory) and problem is not None and "Is a directory" in problem


def test_completion_of_a_path_under_an_unknown_user_is_nothing() -> None:
    from ruvllm_cli.chat.commands import file_names

    assert file_names("~no_such_user_ruvllm/") == []


def test_notices_quote_a_loaded_file_s_text_through_terminal_safe() -> None:
    """A chat file's model name reached the terminal as escape sequences (a title, an OSC
    52 clipboard write) through the warning that quotes it."""
    import io

    from rich.console import Console

    from ruvllm_cli.chat.render import PipeRenderer, TerminalRenderer

    for make in (lambda c: TerminalRenderer(c), lambda c: PipeRenderer(c)):
        buffer = io.StringIO()
        renderer = make(Console(file=buffer, force_terminal=False, width=200))
        renderer.warn("it was saved with evil\x1b]0;PWNED\x1b\\")
        renderer.error("unknown command /x\x1b]52;c;aGk=\x07", "hint\x1b[5m")
        renderer.info("model \x1b[31mred")
        assert "\x1b" not in buffer.getvalue() and "\\x1b]0;PWNED" in buffer.getvalue()


def test_a_piped_reply_to_a_terminal_goes_through_terminal_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    """`echo hi | ruvllm chat M` typed in a shell wrote the model's ESC and SO bytes to the
    terminal; to a file or a pipe the reply stays byte for byte."""
    import io

    from rich.console import Console

    from ruvllm_cli.chat.render import PipeRenderer

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, expected in ((Terminal(), "a\\x1bhb\\x0ec"), (io.StringIO(), "a\x1bhb\x0ec")):
        monkeypatch.setattr("sys.stdout", stream)
        PipeRenderer(Console(file=io.StringIO())).reply_text("a\x1bhb\x0ec")
        assert stream.getvalue() == expected


def test_arguments_split_on_any_whitespace_and_commands_without_any_refuse_them(conv: Conversation) -> None:
    """A helper's pass: "/temp\\t0.5" was an unknown command; "/clear all" cleared and
    "/q later" quit, their arguments dropped in silence."""
    run_command(conv, "/temp\t0.5")
    assert conv.session.settings.temperature == 0.5
    conv.send("hello")
    for line in ("/clear all", "/q later", "/help me"):
        with pytest.raises(UsageError, match="takes no arguments"):
            run_command(conv, line)
    assert len(conv.session.messages) == 2


def test_a_save_clears_the_temp_files_of_saves_killed_midway(conv: Conversation) -> None:
    """Each default save has a name of its own, so a killed save's temp file matched no
    later save's name and stayed for good (write_text_atomic clears its own name's)."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    chats = conv.chats_dir
    chats.mkdir(parents=True)
    dead = chats / f".chat-20260101-000000.json.{gone.pid}.k2j4h1x0.tmp"
    alive = chats / f".chat-20260101-000001.json.{os.getpid()}.a8f3k2m1.tmp"
    other = chats / f".notes.json.{gone.pid}.q1w2e3r4.tmp"
    for path in (dead, alive, other):
        path.write_text("{")
    run_command(conv, "/save")
    assert not dead.exists() and alive.exists() and other.exists()
    assert len(list(chats.glob("chat-*.json"))) == 1
