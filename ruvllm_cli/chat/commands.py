"""The slash commands: one table (name, arguments, help, handler), one small handler each.

Handlers get the conversation and the text after the command name. A bad argument
raises UsageError (the REPL prints it and carries on); `/quit` returns `Action.QUIT`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from pathlib import Path

from ruvllm_cli.chat.conversation import BASE_MODEL_WORDS, Conversation, adapter_choice
from ruvllm_cli.chat.render import adapter_label, format_stats_details
from ruvllm_cli.chat.session import canonical_param, param_names, parse_param
from ruvllm_cli.errors import RuvllmError, UsageError
from ruvllm_cli.fsutil import remove_dead_writers_files


class Action(Enum):
    CONTINUE = "continue"
    QUIT = "quit"


Handler = Callable[[Conversation, str], "Action | None"]


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    help: str
    handler: Handler
    aliases: tuple[str, ...] = ()


# ---------------------------------------------------------------- handlers

def cmd_help(conv: Conversation, arg: str) -> None:
    conv.renderer.rows([(f"/{c.name} {c.args}".rstrip() + _alias_note(c), c.help) for c in COMMANDS])
    conv.renderer.info('Multi-line input: a line of """ opens and closes a block (pasting works too).')


def _alias_note(command: Command) -> str:
    return "".join(f" | /{alias}" for alias in command.aliases)


def cmd_clear(conv: Conversation, arg: str) -> None:
    conv.session.clear()
    conv.last_reply = None
    conv.renderer.info("Conversation cleared (system prompt and settings kept).")


def cmd_system(conv: Conversation, arg: str) -> None:
    session = conv.session
    if arg == "--clear":
        session.system_prompt = None
        conv.renderer.info("System prompt removed.")
    elif arg:
        session.system_prompt = arg
        conv.renderer.info(f"System prompt set: {arg}")
        warning = session.system_prompt_warning()
        if warning:
            conv.renderer.warn(warning)
    elif session.system_prompt:
        conv.renderer.info(f"System prompt: {session.system_prompt}")
    else:
        conv.renderer.info("No system prompt. Set one with /system <prompt> (/system --clear removes it).")


def _show_or_set(conv: Conversation, name: str, arg: str) -> None:
    session = conv.session
    if arg:
        value = parse_param(name, arg)
        if name == "max_tokens":
            check_fits_context(session.context_limit, value)
        session.settings = session.settings.replace(**{name: value})
    conv.renderer.info(f"{name} = {getattr(session.settings, name)}")


def check_fits_context(limit: int, max_tokens: object, name: str = "max_tokens") -> None:
    """A reply cannot outgrow the context window: /max (or --max-tokens) beyond it would
    only mislead."""
    if isinstance(max_tokens, int) and max_tokens > limit:
        shown = " (/tokens shows how much the conversation takes)" if name == "max_tokens" else ""
        raise UsageError(f"{name} {max_tokens} is beyond the model's {limit}-token context",
                         f"a reply ends where the context does: give at most {limit}{shown}")


def cmd_temp(conv: Conversation, arg: str) -> None:
    _show_or_set(conv, "temperature", arg)


def cmd_max(conv: Conversation, arg: str) -> None:
    _show_or_set(conv, "max_tokens", arg)


def cmd_set(conv: Conversation, arg: str) -> None:
    parts = arg.split(maxsplit=1)
    if not parts:
        settings = conv.session.settings
        conv.renderer.rows([(name, str(getattr(settings, name))) for name in param_names()])
        return
    name = canonical_param(parts[0])
    _show_or_set(conv, name, parts[1] if len(parts) > 1 else "")


def cmd_think(conv: Conversation, arg: str) -> None:
    """Ollama's /set think and nothink: the chat template's enable_thinking (Qwen3)."""
    template = conv.session.template
    kwargs = dict(getattr(template, "kwargs", None) or {})
    if not arg:
        state = {True: "on", False: "off"}.get(kwargs.get("enable_thinking"), "as the chat template has it")
        conv.renderer.info(f"Thinking: {state}.")
        return
    value = {"on": True, "off": False}.get(arg.lower())
    if value is None:
        raise UsageError(f"/think takes on or off, not {arg!r}")
    if "enable_thinking" not in (getattr(getattr(template, "tokenizer", None), "chat_template", None) or ""):
        raise UsageError("this model's chat template has no enable_thinking switch: /think changes nothing")
    template.kwargs = {**kwargs, "enable_thinking": value}   # type: ignore[attr-defined]
    conv.renderer.info(f"Thinking {arg.lower()}: the next replies {'reason first' if value else 'answer at once'}.")


def cmd_adapter(conv: Conversation, arg: str) -> None:
    if arg:
        conv.use_adapter(adapter_choice(arg))
        conv.renderer.info(f"Replies now come from {adapter_label(conv.session.adapter)}.")
        return
    current = f"Replies come from {adapter_label(conv.session.adapter)}"
    if conv.adapters:
        conv.renderer.info(f"{current}; loaded: {', '.join(conv.adapters)} (/adapter NAME switches, "
                           "/adapter base goes back).")
    else:
        conv.renderer.info(f"{current}; no LoRA adapter is loaded (start chat with --lora NAME=PATH).")


def cmd_save(conv: Conversation, arg: str) -> None:
    path = _save_target(conv.chats_dir, arg)
    try:
        # Each save gets a new name: the temp files of saves killed midway match none of
        # them, so the next save clears every chat name's (write_text_atomic, its own only).
        remove_dead_writers_files(path, CHAT_NAMES)
        conv.session.save(path)
    except OSError as error:
        raise RuvllmError(f"cannot save to {path}: {error.strerror or error}") from None
    conv.renderer.info(f"Saved {len(conv.session.messages)} messages to {path}")


def _save_target(chats_dir: Path, arg: str) -> Path:
    """Where /save writes: a new name in the chats directory, or in a directory given;
    a file given is written through its symlinks, and only ever a regular file (the
    save replaces the file: /save /dev/null as root had replaced the device)."""
    if not arg:
        return new_chat_path(chats_dir)
    path = _user_path(arg)
    try:
        if path.is_dir():
            return new_chat_path(path)
        if arg.endswith("/"):   # a directory meant (Path drops the slash: it had written sv/a.json)
            raise UsageError(f"cannot save to {arg}: no directory {path}", "create it first, or give another path")
        if path.is_symlink():
            path = path.resolve()
        if path.exists() and not path.is_file():
            raise UsageError(f"cannot save to {path}: not a regular file", "give a file name: /save <file>")
        if not path.parent.is_dir():
            raise UsageError(f"cannot save to {path}: no directory {path.parent}",
                             "create it first, or give another path")
    except OSError as error:
        raise UsageError(f"cannot save to {arg}: {error.strerror or error}") from None
    return path


def _user_path(arg: str) -> Path:
    """A path as typed, `~` and `~user` expanded (a user with no home directory is a
    one-line error, not the REPL's end)."""
    try:
        return Path(arg).expanduser()
    except RuntimeError as error:
        raise UsageError(f"{arg}: {error}") from None


def cmd_load(conv: Conversation, arg: str) -> None:
    path = _user_path(arg) if arg else newest_chat(conv.chats_dir)
    try:
        if arg and not path.exists() and (conv.chats_dir / arg).is_file():
            path = conv.chats_dir / arg  # a saved chat by its name, as Tab completes it
    except OSError as error:   # a name too long, a path through a file
        raise UsageError(f"cannot read {arg}: {error.strerror or error}") from None
    session = conv.session
    adapter_before = session.adapter
    model = session.load(path)
    conv.last_reply = None
    count = len(session.messages)
    conv.renderer.info(f"Loaded {count} message{'' if count == 1 else 's'} from {path}")
    if session.awaits_reply:
        conv.renderer.info("Its last message has no reply yet: /retry answers it.")
    if model and model != session.model:
        conv.renderer.warn(f"it was saved with {model}; replies now come from {session.model}")
    _load_adapter(conv, adapter_before)


def _load_adapter(conv: Conversation, before: str | None) -> None:
    """After /load: the saved chat's adapter if it is loaded, else the base model."""
    saved = conv.session.adapter
    if saved is not None and saved not in conv.adapters:
        conv.session.adapter = None
        conv.renderer.warn(f"it was saved with LoRA adapter {saved}, which is not loaded; replies now come "
                           "from the base model")
    elif saved != before:
        conv.renderer.info(f"Replies now come from {adapter_label(saved)}.")


CHAT_NAMES = "chat-*.json"   # new_chat_path's names


def new_chat_path(chats_dir: Path) -> Path:
    """A name no saved chat has yet: the time to the second, and a count after it for
    a second save (this chat's or another's) within the same second."""
    stem = f"chat-{datetime.now():%Y%m%d-%H%M%S}"
    path, count = chats_dir / f"{stem}.json", 1
    while path.exists():
        count += 1
        path = chats_dir / f"{stem}-{count}.json"
    return path


def newest_chat(chats_dir: Path) -> Path:
    files = sorted(chats_dir.glob(CHAT_NAMES), key=lambda p: p.stat().st_mtime) if chats_dir.is_dir() else []
    if not files:
        raise UsageError(f"no saved chats in {chats_dir}", "give a file: /load <file>")
    return files[-1]


def cmd_history(conv: Conversation, arg: str) -> None:
    session, renderer = conv.session, conv.renderer
    if session.system_prompt:
        renderer.info(f"System: {session.system_prompt}")
    if not session.messages:
        renderer.info("No messages yet.")
    for message in session.messages:
        who = "You" if message.role == "user" else "Assistant"
        mark = " [interrupted]" if message.interrupted else ""
        renderer.info(f"{who}: {message.content}{mark}")


def cmd_tokens(conv: Conversation, arg: str) -> None:
    session = conv.session
    used, limit = session.count_tokens(), session.context_limit
    conv.renderer.info(f"{used} tokens in the conversation of a {limit}-token context "
                       f"({100 * used / limit:.0f}%); {session.reply_reserve} kept free for the next reply")


def cmd_retry(conv: Conversation, arg: str) -> None:
    conv.retry()


def cmd_stats(conv: Conversation, arg: str) -> None:
    if conv.last_reply is None:
        conv.renderer.info("No reply yet.")
        return
    conv.renderer.info("Last reply:")
    conv.renderer.rows(format_stats_details(conv.last_reply))


def cmd_quit(conv: Conversation, arg: str) -> Action:
    return Action.QUIT


COMMANDS: list[Command] = [
    Command("help", "", "Show the commands.", cmd_help),
    Command("clear", "", "Start the conversation again (keeps system prompt and settings).", cmd_clear),
    Command("system", "[prompt]", "Show or set the system prompt (--clear removes it).", cmd_system),
    Command("temp", "[value]", "Show or set the temperature (0 to 2; 0 is greedy).", cmd_temp),
    Command("max", "[n]", "Show or set the most tokens per reply.", cmd_max),
    Command("set", "[param value]", f"Show or set a sampling parameter: {', '.join(param_names())}.", cmd_set),
    Command("think", "[on|off]", "Show or switch a reasoning model's thinking (templates with enable_thinking, "
                                 "as Qwen3's).", cmd_think),
    Command("adapter", "[name|base]", "Show the LoRA adapter replies come from and the loaded ones, or switch "
            "(base: the base model).", cmd_adapter),
    Command("save", "[file]", "Save the chat (model, system prompt, parameters, adapter, messages) as JSON "
            "(default: a new file in the data dir's chats/).", cmd_save),
    Command("load", "[file]", "Load a saved chat, its parameters and adapter too: a file, or a saved chat's "
            "name (Tab lists them; default: the newest saved).", cmd_load),
    Command("history", "", "Show the conversation.", cmd_history),
    Command("tokens", "", "Count the conversation's tokens against the context limit.", cmd_tokens),
    Command("retry", "", "Generate the last reply again.", cmd_retry),
    Command("stats", "", "Show the last reply's TTFT, tokens and speed.", cmd_stats),
    Command("quit", "", "Leave the chat (Ctrl-D works too).", cmd_quit, ("exit", "q")),
]


# ---------------------------------------------------------------- dispatch and completion

def lookup(name: str) -> Command | None:
    name = name.lower()
    return next((c for c in COMMANDS if name == c.name or name in c.aliases), None)


def command_names() -> list[str]:
    return [name for c in COMMANDS for name in (c.name, *c.aliases)]


def is_command(line: str) -> bool:
    return line.lstrip().startswith("/")


def run_command(conv: Conversation, line: str) -> Action:
    """Run one `/command args` line; UsageError for an unknown command (with a suggestion)."""
    if "\0" in line:   # a path with one raised ValueError, which ended the chat
        raise UsageError("a command must not contain a NUL character")
    name, arg = (line.strip()[1:].split(maxsplit=1) + ["", ""])[:2]   # any whitespace: "/temp\t0.5"
    command = lookup(name)
    if command is None:
        raise unknown_command(name)
    if arg and not command.args:   # "/clear all" had cleared, "/q later" quit
        raise UsageError(f"/{command.name} takes no arguments", f"type /{command.name} alone")
    return command.handler(conv, arg.strip()) or Action.CONTINUE


def unknown_command(name: str) -> UsageError:
    close = difflib.get_close_matches(name.lower(), command_names(), n=1, cutoff=0.5)
    hint = f"did you mean /{close[0]}? " if close else ""
    return UsageError(f"unknown command /{name}", f"{hint}/help lists the commands")


def completions(text: str, chats_dir: Path | None = None, adapters: Sequence[str] = ()) -> list[str]:
    """Candidates for the word being typed: command names after `/`, then each
    command's values: parameter names after `/set `, `--clear` after `/system `, file
    names after `/save ` and `/load ` (and the saved chats' names in `chats_dir` after
    `/load `), `base` and the loaded `adapters` after `/adapter `. Each candidate
    replaces that whole word (`completion_word`: a path, spaces and all)."""
    if not is_command(text):
        return []
    words = text.lstrip().split(" ")
    if len(words) == 1:
        return ["/" + n for n in command_names() if ("/" + n).startswith(words[0].lower())]
    command, word = lookup(words[0][1:]), completion_word(text)
    name = command.name if command is not None else ""
    if len(words) != 2 and name not in PATH_COMMANDS:
        return []
    if name == "set":
        return [n for n in param_names() if n.startswith(word.lower())]
    if name == "system":
        return ["--clear"] if "--clear".startswith(word) and word else []
    if name == "adapter":
        return [n for n in (BASE_MODEL_WORDS[0], *adapters) if n.startswith(word)]
    if name in PATH_COMMANDS:
        saved = saved_chats(chats_dir) if name == "load" and "/" not in word else []
        return [n for n in saved if n.startswith(word)] + file_names(word)
    return []


PATH_COMMANDS = ("save", "load")   # their argument is the rest of the line: a path may hold spaces


def completion_word(text: str) -> str:
    """What a candidate replaces: the rest of the line after /save or /load (a path with
    a space in it had stopped completing), else the last space-separated word."""
    head, space, rest = text.lstrip().partition(" ")
    command = lookup(head[1:]) if space and is_command(head) else None
    return rest if command is not None and command.name in PATH_COMMANDS else text.split(" ")[-1]


def saved_chats(chats_dir: Path | None) -> list[str]:
    """The names of the chats saved in `chats_dir`, newest first (`/load NAME` finds them)."""
    if chats_dir is None or not chats_dir.is_dir():
        return []
    files = sorted(chats_dir.glob(CHAT_NAMES), key=lambda p: p.stat().st_mtime, reverse=True)
    return [f.name for f in files]


def file_names(word: str) -> list[str]:
    """Paths that complete `word` as typed (directories end in `/`; hidden files only
    once a `.` is typed)."""
    head, _, stem = word.rpartition("/")
    prefix = f"{head}/" if head or word.startswith("/") else ""
    try:
        directory = Path(head or ("/" if word.startswith("/") else ".")).expanduser()
        entries = sorted(directory.iterdir())
    except (OSError, RuntimeError, ValueError):   # RuntimeError: ~user with no home directory
        return []
    return [prefix + entry.name + ("/" if entry.is_dir() else "") for entry in entries
            if entry.name.startswith(stem) and (stem.startswith(".") or not entry.name.startswith("."))]
