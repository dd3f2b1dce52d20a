"""The real REPL in a pseudo-terminal (pexpect): `python -m ruvllm_cli chat <tiny model>`.

Random weights answer gibberish, so these tests check structure: prompts, stats lines,
command output, the files written, the exit status.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pexpect
import pytest

pytestmark = pytest.mark.timeout(90)

PROMPT = "You>"
STATS = r"\d+ tokens? · TTFT \d+(\.\d+)? m?s · (\d+\.\d tok/s|n/a tok/s)"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


def run(child: Any, line: str, *expected: str) -> None:
    """Type a line, expect each pattern in order, then the next prompt."""
    child.sendline(line)
    for pattern in expected:
        child.expect(pattern)
    child.expect(PROMPT)


def saved(child: Any, path: Path) -> dict[str, Any]:
    run(child, f"/save {path}", "Saved \\d+ messages to")
    return json.loads(path.read_text())


def test_a_conversation_with_commands(spawn_chat: Callable[..., Any], tmp_path: Path, tiny_model_dir: Path) -> None:
    child = spawn_chat("--max-tokens", "16", "--seed", "1")
    child.expect(r"ruvllm chat\S* · \S+ · cpu · float32 · context 4096 tokens")
    child.expect(PROMPT)

    run(child, "hello there", STATS)
    run(child, "how are you?", STATS)
    run(child, "/system You are a pirate.", "System prompt set: You are a pirate.")
    run(child, "/temp 3", re.escape("temperature must be between 0 and 2 (got 3.0)"))
    run(child, "/temp", re.escape("temperature = 0.7"))
    run(child, "/hepl", "unknown command /hepl", "did you mean /help\\?")
    child.send("/hist")
    child.send("\t")  # Tab completes it to /history
    run(child, "", "System: You are a pirate.", "You: hello there", "Assistant: ", "You: how are you\\?")
    run(child, "/tokens", r"\d+ tokens in the conversation of a 4096-token context")

    first = saved(child, tmp_path / "first.json")
    assert first["model"] == tiny_model_dir.name and first["system_prompt"] == "You are a pirate."
    assert first["parameters"]["temperature"] == 0.7 and first["parameters"]["max_tokens"] == 16
    assert first["parameters"]["seed"] == 1
    assert [m["role"] for m in first["messages"]] == ["user", "assistant"] * 2
    assert [m["content"] for m in first["messages"][::2]] == ["hello there", "how are you?"]

    run(child, "/temp 2", "temperature = 2.0")
    run(child, "/retry", STATS)
    run(child, "/stats", "Last reply:", "TTFT", r"\d+ tokens, \d+ from the prefix cache")
    retried = saved(child, tmp_path / "retried.json")
    assert retried["messages"][:3] == first["messages"][:3]
    assert retried["messages"][3]["role"] == "assistant" and len(retried["messages"]) == 4
    assert retried["messages"][3]["content"] != first["messages"][3]["content"]

    run(child, "/clear", "Conversation cleared")
    run(child, "/system --clear", "System prompt removed.")
    run(child, f"/load {tmp_path / 'first.json'}", "Loaded 4 messages from")
    run(child, "/temp", re.escape("temperature = 0.7"))
    run(child, "/history", "System: You are a pirate.", "You: hello there")
    run(child, "and now?", STATS)

    # A """ block, then a bracketed paste: each arrives as one multi-line message.
    child.sendline('"""')
    child.sendline("first line")
    child.sendline('second line"""')
    child.expect(STATS)
    child.expect(PROMPT)
    child.send("\x1b[200~pasted one\npasted two\x1b[201~")
    run(child, "", STATS)
    multi = saved(child, tmp_path / "multi.json")
    assert [m["content"] for m in multi["messages"][::2]] == [
        "hello there", "how are you?", "and now?", "first line\nsecond line", "pasted one\npasted two"]

    child.sendeof()
    child.expect("Goodbye.")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    history = (tmp_path / "chat-cache" / "chat_history").read_text()
    for line in ("+hello there", "+/temp 3", "+/retry", "+and now?", "+pasted one", "+pasted two"):
        assert line in history.splitlines()


def test_ctrl_c_stops_a_reply_and_clears_the_prompt(spawn_chat: Callable[..., Any], isolated_env: Any) -> None:
    child = spawn_chat("-t", "0", "--max-tokens", "3000")
    child.expect(PROMPT)
    child.send("a draft I do not want")
    time.sleep(0.3)
    child.send("\x03")  # at the prompt: clears the line
    child.expect(PROMPT)
    run(child, "/history", "No messages yet.")

    # Greedy decoding of the tiny model loops on this prompt well past 0.3 s (no EOS).
    child.sendline("Count to one thousand.")
    child.expect("thousand\\.")
    time.sleep(0.3)  # let the reply stream for a while
    child.send("typed early")
    time.sleep(0.2)
    child.send("\x03")
    child.expect("the partial reply stays in the conversation")  # after a yellow "Interrupted:"
    # The terminal's echo is off while a reply streams: neither the keys nor "^C" land in
    # it (the typed keys wait for the next prompt; Ctrl-C's signal flushes them, as a
    # terminal does).
    assert "^C" not in child.before and "typed early" not in child.before
    child.expect(STATS)
    stats = ANSI.sub("", child.after)
    assert int(stats.split()[0]) < 3000
    child.expect(PROMPT)

    run(child, "/max 8", "max_tokens = 8")
    run(child, "Go on.", STATS)
    run(child, "/history", "You: Count to one thousand.", r"\[interrupted\]", "You: Go on.")
    # Issue 23, item 8: saved in the data dir, which clearing the cache leaves alone.
    run(child, "/save", "Saved 4 messages to " + re.escape(str(isolated_env.data_dir / "chats" / "chat-")))
    assert len(list((isolated_env.data_dir / "chats").glob("chat-*.json"))) == 1
    child.sendline("/quit")
    child.expect("Goodbye.")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_a_block_or_a_paste_starting_with_a_slash_is_a_message(spawn_chat: Callable[..., Any],
                                                               tmp_path: Path) -> None:
    """Only a typed line is a command: a \"\"\" block or a multi-line paste that starts
    with "/" (a path, a // comment) is sent, as written (it was "unknown command")."""
    child = spawn_chat("--max-tokens", "4")
    child.expect(PROMPT)
    child.sendline('"""')
    child.sendline("/etc/hosts is empty, why?")
    child.sendline('"""')
    child.expect(STATS)
    child.expect(PROMPT)
    child.send("\x1b[200~// explain this\nint main(){}\x1b[201~")
    run(child, "", STATS)
    # Ctrl-D inside a block ends the block (it had ended the whole chat, the block lost)
    child.sendline('"""')
    child.sendline("ended by ctrl-d")
    child.sendcontrol("d")
    child.expect(STATS)
    child.expect(PROMPT)
    # A paste that starts with """ (a module's docstring) is sent whole: it had opened a block
    child.send('\x1b[200~"""Module doc."""\nimport os\x1b[201~')
    run(child, "", STATS)
    run(child, "/history", "You: /etc/hosts is empty, why\\?", "You: // explain this", "You: ended by ctrl-d",
        'You: """Module doc."""\r?\nimport os')
    child.sendline("/quit")
    child.expect(pexpect.EOF)


def test_stdin_a_terminal_and_stdout_piped_is_one_clear_error(tiny_model_dir: Path, cli_env: dict[str, str],
                                                              tmp_path: Path) -> None:
    """`ruvllm chat MODEL | tee log`: the prompt would draw into the pipe and nothing on
    the screen; it says so instead, before loading the model."""
    import os
    import subprocess
    import sys

    main, secondary = os.openpty()
    try:
        done = subprocess.run([sys.executable, "-m", "ruvllm_cli", "chat", str(tiny_model_dir)], stdin=secondary,
                              capture_output=True, text=True, env=cli_env, cwd=tmp_path, timeout=60)
    finally:
        os.close(main)
        os.close(secondary)
    assert done.returncode == 2 and done.stdout == ""
    assert "needs a terminal on stdout" in done.stderr and "Traceback" not in done.stderr


def test_sigterm_at_the_prompt_gives_the_terminal_back(tiny_model_dir: Path, cli_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    """A helper's pass: killed at the `You>` prompt (prompt-toolkit keeps the terminal raw
    there), the shell was left without echo, line editing or Ctrl-C."""
    import shlex
    import signal
    import subprocess
    import sys

    env = {**cli_env, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1"}
    chat = shlex.join([sys.executable, "-m", "ruvllm_cli", "chat", str(tiny_model_dir), "-q", "none",
                       "--cache-dir", str(tmp_path / "chat-cache")])
    child = pexpect.spawn("bash", ["-c", f"{chat}; echo EXIT=$?; stty -a"], cwd=str(tmp_path), env=env,
                          encoding="utf-8", codec_errors="replace", dimensions=(24, 100), timeout=60)
    try:
        child.expect(PROMPT)
        pid = int(subprocess.run(["pgrep", "-P", str(child.pid)], capture_output=True, text=True).stdout.split()[0])
        os.kill(pid, signal.SIGTERM)
        child.expect(r"EXIT=(\d+)")
        assert child.match.group(1) == "143"
        child.expect(pexpect.EOF)
        settings = child.before.split()
        assert {"isig", "icanon", "echo"} <= set(settings), child.before
    finally:
        child.close(force=True)
