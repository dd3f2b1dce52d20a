"""LoRA adapters in chat: `--lora NAME=PATH`, `--adapter NAME` and `/adapter`, on the
tiny model with two random peft adapters. Greedy replies are compared with the
engine's own `generate(..., adapters=NAME)` for the same prompt ids."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ruvllm_cli.chat.commands import run_command
from ruvllm_cli.chat.conversation import Conversation
from ruvllm_cli.chat.session import ChatSession, ChatSettings

Run = Callable[..., subprocess.CompletedProcess[str]]
MESSAGE = "What is the weather like in Paris?"
SETTINGS = ChatSettings(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from ruvllm_cli.testing.tiny_lora import build_lora_adapter

    root = tmp_path_factory.mktemp("chat-adapters")
    return {"sql": build_lora_adapter(tiny_model_dir, root / "sql", rank=4, seed=1),
            "chat": build_lora_adapter(tiny_model_dir, root / "chat", rank=8, seed=2)}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> Any:
    """An engine of its own: adapters wrap the model's layers, so the session's shared
    `loaded_model` stays untouched."""
    from ruvllm_cli.engine.config import EngineConfig
    from ruvllm_cli.engine.engine import LLMEngine
    from ruvllm_cli.quantization import Quantization

    engine = LLMEngine.from_path(str(tiny_model_dir), EngineConfig(device="cpu", quantization=Quantization.F32,
                                                                  max_num_seqs=1))
    for name, path in adapter_dirs.items():
        engine.add_lora(name, path)
    return engine


@pytest.fixture(scope="module")
def expected(engine: Any, template: Any) -> dict[str | None, Any]:
    """The greedy reply to MESSAGE from the base model and from each adapter."""
    ids = template([{"role": "user", "content": MESSAGE}], True)
    replies = {name: engine.generate([ids], SETTINGS.sampling_params(), adapters=name)[0]
               for name in (None, "sql", "chat")}
    ids_seen = {tuple(reply.token_ids) for reply in replies.values()}
    assert len(ids_seen) == 3 and all(ids_seen), "each adapter must change the reply"
    return replies


class Quiet:
    def reply_text(self, text: str) -> None:
        pass

    def reply_end(self, reply: Any, max_tokens: int) -> None:
        pass

    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        raise AssertionError(message)


@pytest.fixture
def conversation(engine: Any, template: Any, expected: Any, tmp_path: Path) -> Iterator[Conversation]:
    from ruvllm_cli.engine.loop import EngineLoop

    loop = EngineLoop(engine)
    session = ChatSession(template, engine.max_model_len, model="tiny", settings=SETTINGS)
    yield Conversation(session, loop, Quiet(), chats_dir=tmp_path,  # type: ignore[arg-type]
                       adapters=tuple(engine.lora.names()))
    loop.shutdown()


def test_each_reply_comes_from_the_adapter_in_use(conversation: Conversation, expected: Any) -> None:
    for line, name in [("/adapter sql", "sql"), ("/adapter chat", "chat"), ("/adapter base", None),
                       ("/adapter sql", "sql")]:
        run_command(conversation, line)
        run_command(conversation, "/clear")
        assert conversation.send(MESSAGE).text == expected[name].text, line


def test_retry_uses_the_adapter_switched_to(conversation: Conversation, expected: Any) -> None:
    assert conversation.send(MESSAGE).text == expected[None].text
    run_command(conversation, "/adapter chat")
    run_command(conversation, "/retry")
    assert conversation.session.messages[-1].content == expected["chat"].text


def chat(ruvllm: Run, model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return ruvllm("chat", str(model), "-q", "none", "-t", "0", "--max-tokens", "12", *args, input=MESSAGE + "\n")


def test_piped_chat_answers_with_the_adapter_given(ruvllm: Run, tiny_model_dir: Path,
                                                   adapter_dirs: dict[str, Path], expected: Any) -> None:
    loras = [arg for name, path in adapter_dirs.items() for arg in ("--lora", f"{name}={path}")]
    result = chat(ruvllm, tiny_model_dir, *loras, "--adapter", "chat")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected["chat"].text + "\n"
    assert "LoRA adapter sql (rank 4" in result.stderr and "LoRA adapter chat (rank 8" in result.stderr
    # ruvllm's own lines only: not bitsandbytes' advice (peft imports it) to install `kernels`.
    assert [line for line in result.stderr.splitlines()
            if not line.startswith(("Loaded ", "LoRA adapter ", "ruvllm: building"))] == []
    base = chat(ruvllm, tiny_model_dir, *loras)
    assert base.returncode == 0, base.stderr
    assert base.stdout == expected[None].text + "\n"


@pytest.mark.parametrize(("args", "error"), [
    (["--lora", "sql={sql}", "--adapter", "nope"],
     "Error: --adapter: no LoRA adapter named nope is loaded (loaded: sql)"),
    (["--adapter", "sql"],
     "Error: --adapter: no LoRA adapter named sql is loaded (loaded: none; chat loads adapters with --lora "
     "NAME=PATH)"),
    (["--lora", "base={sql}"],
     "Error: --lora: in chat the name base stands for the base model (/adapter base); give the adapter another name"),
])
def test_a_wrong_adapter_is_one_line_before_the_model_loads(ruvllm: Run, tiny_model_dir: Path,
                                                            adapter_dirs: dict[str, Path], args: list[str],
                                                            error: str) -> None:
    result = chat(ruvllm, tiny_model_dir, *(arg.format(sql=adapter_dirs["sql"]) for arg in args))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [error]


@pytest.mark.timeout(90)
def test_the_repl_switches_completes_and_saves_the_adapter(spawn_chat: Callable[..., Any], tmp_path: Path,
                                                           adapter_dirs: dict[str, Path]) -> None:
    child = spawn_chat("--lora", f"sql={adapter_dirs['sql']}", "--lora", f"chat={adapter_dirs['chat']}",
                       "--adapter", "sql", "--max-tokens", "4")
    child.expect(r"Replies come from adapter sql \(LoRA adapters: sql, chat; /adapter switches\)")
    child.expect("You>")
    child.sendline("/adapter")
    child.expect(r"Replies come from adapter sql; loaded: sql, chat")
    child.expect("You>")
    child.send("/adapter ch")
    child.send("\t")  # Tab completes the adapter's name
    child.sendline("")
    child.expect(r"Replies now come from adapter chat\.")
    child.expect("You>")
    child.sendline("/adapter nope")
    child.expect(r"no LoRA adapter named nope is loaded \(loaded: sql, chat\)")
    child.expect("You>")
    child.sendline("hello")
    child.expect(r"\d+ tokens? · TTFT")
    child.expect("You>")
    child.sendline(f"/save {tmp_path / 'chat.json'}")
    child.expect("Saved 2 messages to")
    child.expect("You>")
    child.sendline("/adapter base")
    child.expect(r"Replies now come from the base model\.")
    child.expect("You>")
    child.sendeof()
    child.expect("Goodbye.")
    assert json.loads((tmp_path / "chat.json").read_text(encoding="utf-8"))["adapter"] == "chat"
