"""kill -9 during /save: the chat file is the old one or the new one, never a torn one.

A helper process saves over an existing chat with the real `/save` command, once per
kill point, in a forked child that SIGKILLs itself at that point: just before and
just after every file-system call the save makes (open, write, flush, fsync, close,
replace, ...), however deep. A plain `open(path, "w").write(...)` fails at the point
after the open, which has already emptied the old file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

if not hasattr(os, "fork"):
    pytest.skip("needs fork and SIGKILL", allow_module_level=True)

# argv: the chat file. Prints one JSON line per kill point.
HELPER = r'''
import io, json, os, signal, sys
from pathlib import Path
from ruvllm_cli.chat.commands import run_command
from ruvllm_cli.chat.conversation import Conversation
from ruvllm_cli.chat.session import ChatSession

FS_CALLS = {"open", "fsync", "fdatasync", "replace", "rename", "truncate", "ftruncate", "unlink", "remove"}


class Quiet:
    def info(self, message): pass
    def warn(self, message): pass


def conversation(path, turns):
    session = ChatSession(template=lambda messages, prompt: [], context_limit=4096, model="tiny")
    for i in range(turns):
        session.add_user(f"question {i}: " + "why? " * 4000)
        session.add_reply(f"answer {i}: " + "because. " * 4000)
    return Conversation(session, loop=None, renderer=Quiet(), chats_dir=path.parent)


def is_fs_call(function):
    return isinstance(getattr(function, "__self__", None), io.IOBase) or function.__name__ in FS_CALLS


def kill_at(point):
    seen = 0
    def profile(frame, event, function):
        nonlocal seen
        if event in ("c_call", "c_return") and is_fs_call(function):
            seen += 1
            if seen == point:
                os.kill(os.getpid(), signal.SIGKILL)
    sys.setprofile(profile)


def classify(path, old, new_messages):
    data = path.read_bytes()
    if data == old:
        return "old"
    try:
        return "new" if json.loads(data)["messages"] == new_messages else "other"
    except (ValueError, KeyError, TypeError):
        return f"torn at {len(data)} bytes"


path = Path(sys.argv[1])
run_command(conversation(path, 2), f"/save {path}")
old = path.read_bytes()
new = conversation(path, 12)
new_messages = [m.to_dict() for m in new.session.messages]
for point in range(1, 1000):
    path.write_bytes(old)
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        kill_at(point)
        run_command(new, f"/save {path}")
        sys.setprofile(None)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    others = sorted(p.name for p in path.parent.iterdir() if p != path)
    print(json.dumps({"point": point, "killed": killed, "file": classify(path, old, new_messages),
                      "others": others}))
    for name in others:
        (path.parent / name).unlink()
    if not killed:
        break
'''


def test_kill_9_at_every_file_system_call_of_save_leaves_the_old_or_the_new_chat(cli_env, tmp_path):
    chat = tmp_path / "chats" / "chat.json"
    chat.parent.mkdir()
    done = subprocess.run([sys.executable, "-c", HELPER, str(chat)], env=cli_env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    points = [json.loads(line) for line in done.stdout.splitlines()]
    killed, finished = points[:-1], points[-1]
    assert finished["killed"] is False and finished["file"] == "new" and finished["others"] == []
    assert [p for p in killed if p["file"] not in ("old", "new")] == []
    assert {p["file"] for p in killed} == {"old", "new"} and all(p["killed"] for p in killed)
    assert len(killed) >= 8   # open, write, flush, fsync, close, replace: each before and after
    first_new = next(p["point"] for p in killed if p["file"] == "new")
    assert all(p["file"] == ("old" if p["point"] < first_new else "new") for p in killed)
    # what a killed save leaves beside the chat is at most its own hidden temp file
    assert all(len(p["others"]) <= 1 and all(n.startswith(".chat.json.") and n.endswith(".tmp")
                                               for n in p["others"]) for p in killed)


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    from ruvllm_cli.fsutil import write_text_atomic

    chat = tmp_path / "chat.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()   # a pid whose process has ended
    leftover = tmp_path / f".chat.json.{dead}.k3j2.tmp"
    live = tmp_path / f".chat.json.{os.getppid()}.x9a1.tmp"      # a writer still running: kept
    other = tmp_path / f".other.json.{dead}.q1.tmp"               # another file's: not ours to remove
    for path in (leftover, live, other):
        path.write_text("partial")
    write_text_atomic(chat, "{}")
    assert chat.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["chat.json", live.name, other.name])
