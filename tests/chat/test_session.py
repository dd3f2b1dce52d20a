"""ChatSession without a terminal or a model: token counts through the tiny model's real
chat template, context trimming, warnings, settings validation, chat files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ruvllm_cli.chat.session import ChatSession, ChatSettings, ChatTemplate, Message, canonical_param
from ruvllm_cli.errors import ModelLoadError, RuvllmError, UsageError


def make_session(template: Any, context_limit: int = 4096, **kwargs: Any) -> ChatSession:
    return ChatSession(template, context_limit, model="tiny", **kwargs)


def add_turns(session: ChatSession, count: int, words: int = 6) -> None:
    for i in range(count):
        session.add_user(" ".join(["hello"] * words) + f" {i}")
        session.add_reply(" ".join(["fine"] * words) + f" {i}")


# ---- rendering and counting ------------------------------------------------------------------

def test_prompt_ids_are_the_chat_template_with_the_generation_prompt(template: Any, tokenizer: Any) -> None:
    session = make_session(template, system_prompt="Be brief.")
    session.add_user("hello")
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert session.prompt_ids() == list(expected)
    assert tokenizer.decode(session.prompt_ids()) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")


def test_count_tokens_is_the_rendered_conversation_without_generation_prompt(template: Any, tokenizer: Any) -> None:
    session = make_session(template)
    assert session.count_tokens() == 0
    session.add_user("hello")
    session.add_reply("hi there")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}],
        add_generation_prompt=False, tokenize=True, return_dict=False)
    assert session.count_tokens() == len(rendered)
    without_system = session.count_tokens()
    session.system_prompt = "Be brief."
    assert session.count_tokens() > without_system


def test_an_interrupted_reply_is_rendered_as_its_partial_text(template: Any) -> None:
    session = make_session(template)
    session.add_user("hello")
    session.add_reply("partial", interrupted=True)
    assert session.template_messages() == [{"role": "user", "content": "hello"},
                                           {"role": "assistant", "content": "partial"}]
    assert session.messages[-1].to_dict() == {"role": "assistant", "content": "partial", "interrupted": True}


def test_a_tokenizer_without_chat_template_is_refused() -> None:
    class Plain:
        chat_template = None

    with pytest.raises(ModelLoadError, match="no chat template"):
        ChatTemplate(Plain())


# ---- the context window ---------------------------------------------------------------------

def test_reply_reserve_is_max_tokens_capped_at_half_the_context(template: Any) -> None:
    session = make_session(template, context_limit=256, settings=ChatSettings(max_tokens=16))
    assert (session.reply_reserve, session.budget) == (16, 240)
    session.settings = session.settings.replace(max_tokens=512)
    assert (session.reply_reserve, session.budget) == (128, 128)


def test_fit_context_keeps_a_conversation_that_fits(template: Any) -> None:
    session = make_session(template, context_limit=4096)
    add_turns(session, 3)
    session.add_user("next")
    fit = session.fit_context()
    assert fit.dropped_turns == 0
    assert fit.prompt_ids == session.prompt_ids()
    assert len(session.messages) == 7


def test_fit_context_drops_the_oldest_turns_after_the_system_prompt(template: Any, tokenizer: Any) -> None:
    session = make_session(template, context_limit=128, system_prompt="Be brief.",
                           settings=ChatSettings(max_tokens=32))
    add_turns(session, 4)
    session.add_user("the newest question")
    assert len(session.prompt_ids()) > session.budget
    fit = session.fit_context()
    assert fit.dropped_turns >= 1
    assert len(fit.prompt_ids) <= session.budget == 96
    # Whole turns went, oldest first: what is left starts with a user message, ends with the new one.
    assert session.messages[0].role == "user"
    assert session.messages[0].content.endswith(f" {fit.dropped_turns}")
    assert session.messages[-1].content == "the newest question"
    assert len(session.messages) == 2 * (4 - fit.dropped_turns) + 1
    assert tokenizer.decode(fit.prompt_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_fit_context_drops_no_more_turns_than_needed(template: Any) -> None:
    session = make_session(template, context_limit=128, settings=ChatSettings(max_tokens=32))
    add_turns(session, 4)
    session.add_user("the newest question")
    before = list(session.messages)
    fit = session.fit_context()
    assert fit.dropped_turns >= 1
    kept_one_more = make_session(template, context_limit=128, settings=ChatSettings(max_tokens=32))
    kept_one_more.messages = before[2 * (fit.dropped_turns - 1):]
    assert len(kept_one_more.prompt_ids()) > session.budget


def test_a_message_too_long_for_the_context_is_refused_and_nothing_is_dropped(template: Any) -> None:
    session = make_session(template, context_limit=64, settings=ChatSettings(max_tokens=16))
    add_turns(session, 1, words=2)
    session.add_user(" ".join(["hello"] * 100))
    with pytest.raises(UsageError, match=r"the message needs \d+ tokens with the system prompt; "
                                         r"the context limit is 64"):
        session.fit_context()
    assert len(session.messages) == 3


def test_the_latest_turn_alone_may_use_the_reply_reserve(template: Any) -> None:
    session = make_session(template, context_limit=64, settings=ChatSettings(max_tokens=32))
    session.add_user(" ".join(["hello"] * 12))
    assert session.budget < len(session.prompt_ids()) < 64
    fit = session.fit_context()
    assert fit.dropped_turns == 0 and len(session.messages) == 1


def test_context_warning_comes_once_per_crossing(template: Any) -> None:
    session = make_session(template, context_limit=128, settings=ChatSettings(max_tokens=32))
    assert session.context_warning() is None
    while session.count_tokens() < 0.8 * session.budget:
        add_turns(session, 1, words=2)
    warning = session.context_warning()
    assert warning is not None
    assert warning.startswith(f"the conversation uses {session.count_tokens()} of the 96 tokens it may keep "
                              "(context 128, 32 kept for the reply)")
    assert "oldest turns will be dropped" in warning
    assert session.context_warning() is None
    session.clear()
    assert session.context_warning() is None
    add_turns(session, 6, words=2)
    assert session.context_warning() is not None


def test_context_warning_past_the_budget_says_the_next_message_drops_turns(template: Any) -> None:
    """A reply that ran past the room kept for it: "uses 120 of the 96" had read as a contradiction."""
    session = make_session(template, context_limit=128, settings=ChatSettings(max_tokens=32))
    session.add_user("hello")
    session.add_reply(" ".join(["word"] * 100))
    assert session.count_tokens() > session.budget
    warning = session.context_warning()
    assert warning == (f"the conversation uses {session.count_tokens()} tokens, past the 96 it may keep (context "
                       "128, 32 kept for the reply): the next message drops its oldest turns")


# ---- settings -------------------------------------------------------------------------------

def test_settings_validate_with_the_parameter_name() -> None:
    with pytest.raises(UsageError, match=r"^temperature must be between 0 and 2 \(got 3.0\)$"):
        ChatSettings().replace(temperature=3.0)
    with pytest.raises(UsageError, match="top_p must be in"):
        ChatSettings().with_text("top-p", "0")
    with pytest.raises(UsageError, match=r"^top_k must be a whole number \(got 'abc'\)$"):
        ChatSettings().with_text("top_k", "abc")
    # a seed torch cannot take: every reply had failed with "Overflow when unpacking long long"
    with pytest.raises(UsageError, match=r"^seed must be between -9223372036854775808 and 18446744073709551615"):
        ChatSettings().with_text("seed", "99999999999999999999999")
    assert ChatSettings().with_text("seed", "18446744073709551615").seed == 2**64 - 1


def test_settings_parse_names_and_values() -> None:
    settings = ChatSettings(seed=3).with_text("TOP-P", "0.5").with_text("seed", "none").with_text("temp", "0")
    assert (settings.top_p, settings.seed, settings.temperature) == (0.5, None, 0.0)
    assert settings.with_text("repetition_penalty", "1.1").sampling_params().repetition_penalty == 1.1
    assert canonical_param("max") == "max_tokens"
    with pytest.raises(UsageError) as error:
        canonical_param("top_q")
    assert error.value.hint is not None and error.value.hint.startswith("did you mean top_p? ")


# ---- files ----------------------------------------------------------------------------------

def test_save_then_load_restores_prompt_parameters_and_messages(template: Any, tmp_path: Path) -> None:
    session = make_session(template, system_prompt="Be brief.",
                           settings=ChatSettings(temperature=0.2, top_k=5, seed=7, max_tokens=64))
    session.add_user("hello")
    session.add_reply("hi", interrupted=True)
    path = tmp_path / "sub" / "chat.json"
    session.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "ruvllm-chat" and data["version"] == 1 and data["model"] == "tiny"
    assert data["system_prompt"] == "Be brief."
    assert data["parameters"] == {"temperature": 0.2, "max_tokens": 64, "top_p": 1.0, "top_k": 5, "min_p": 0.0,
                                  "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                  "frequency_penalty": 0.0, "seed": 7}
    assert data["messages"] == [{"role": "user", "content": "hello"},
                                {"role": "assistant", "content": "hi", "interrupted": True}]
    assert data["adapter"] is None
    assert [p.name for p in path.parent.iterdir()] == ["chat.json"]

    other = make_session(template)
    assert other.load(path) == "tiny"
    assert other.system_prompt == "Be brief."
    assert other.settings == session.settings
    assert other.messages == [Message("user", "hello"), Message("assistant", "hi", True)]


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    ('{"messages": []}', "is not a ruvllm chat file"),
    ('{"format": "ruvllm-chat", "parameters": {"temperature": 5}}', "temperature must be between 0 and 2"),
    ('{"format": "ruvllm-chat", "parameters": {"warmth": 1}}', "unknown parameter 'warmth'"),
    ('{"format": "ruvllm-chat", "messages": [{"role": "robot", "content": "x"}]}', "a message must have a role"),
    ('{"format": "ruvllm-chat", "adapter": ["sql"]}', "adapter must be an adapter's name or null"),
])
def test_a_bad_chat_file_changes_nothing(template: Any, tmp_path: Path, content: str, message: str) -> None:
    session = make_session(template, system_prompt="keep")
    session.add_user("keep me")
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(RuvllmError, match=message):
        session.load(path)
    assert session.system_prompt == "keep" and session.messages == [Message("user", "keep me")]
    assert session.settings == ChatSettings()


def test_parameters_a_chat_file_leaves_out_keep_their_values(template: Any, tmp_path: Path) -> None:
    """A helper's pass: a file without parameters reset them to the built-in defaults
    (max_tokens 512, beyond a small model's context: such a file could not load)."""
    session = make_session(template, settings=ChatSettings(max_tokens=6, seed=3))
    path = tmp_path / "partial.json"
    path.write_text('{"format": "ruvllm-chat", "version": 1, "parameters": {"temperature": 0.5}}')
    session.load(path)
    assert session.settings == ChatSettings(max_tokens=6, seed=3, temperature=0.5)
    path.write_text('{"format": "ruvllm-chat", "version": 1, "messages": []}')
    session.load(path)
    assert session.settings == ChatSettings(max_tokens=6, seed=3, temperature=0.5)


def test_loading_a_missing_file_says_so(template: Any, tmp_path: Path) -> None:
    with pytest.raises(RuvllmError, match="no chat file at"):
        make_session(template).load(tmp_path / "nope.json")


def test_a_system_prompt_that_leaves_no_room_is_said_at_once(template: Any) -> None:
    """A helper's pass: a system prompt longer than the context was taken in silence, and
    every message then refused with "send a shorter message"."""
    session = make_session(template, context_limit=320, settings=ChatSettings(max_tokens=64))
    session.system_prompt = "Be brief."
    assert session.system_prompt_warning() is None
    session.system_prompt = " ".join(["S"] * 400)
    warning = session.system_prompt_warning()
    assert warning is not None and "of the 320-token context" in warning and "no message fits" in warning
    session.add_user("hi")
    with pytest.raises(UsageError, match="tokens with the system prompt") as caught:
        session.fit_context()
    assert "shorten the system prompt" in (caught.value.hint or "")
