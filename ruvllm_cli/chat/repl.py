"""The prompt loop: `You> `, history file, multi-line blocks, Tab completion, Ctrl-C/Ctrl-D.

Ctrl-C at the prompt clears the line (prompt-toolkit raises KeyboardInterrupt, we
prompt again); Ctrl-C during a reply is a SIGINT that `reply.cancel_on_interrupt`
turns into a cancel; Ctrl-D on an empty line (EOFError) says goodbye.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, History, InMemoryHistory

from ruvllm_cli.chat.commands import Action, completion_word, completions, is_command, run_command
from ruvllm_cli.chat.conversation import Conversation
from ruvllm_cli.chat.reply import terminal_restored_on_sigterm
from ruvllm_cli.errors import RuvllmError, UsageError

PROMPT = "You> "
CONTINUATION = "... "
BLOCK = '"""'


class SlashCompleter(Completer):
    """Tab completes command names and their values (commands.completions)."""

    def __init__(self, chats_dir: Path | None = None, adapters: Sequence[str] = ()) -> None:
        self.chats_dir = chats_dir
        self.adapters = tuple(adapters)

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterable[Completion]:
        text = document.text_before_cursor
        word = completion_word(text)
        for candidate in completions(text, self.chats_dir, self.adapters):
            yield Completion(candidate, start_position=-len(word))


def open_history(path: Path) -> tuple[History, str | None]:
    """The history file, or (when it cannot be written) one in memory and a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)   # what was typed: as private as saved chats
        # touch succeeds on a directory and on an owner's read-only file (it sets times):
        # prompt-toolkit's appends then failed with a traceback at every prompt.
        with open(path, "ab"):
            pass
    except OSError as error:
        return InMemoryHistory(), (f"cannot write the history file {path} ({error.strerror or error}); "
                                   "this session's input is not kept")
    return FileHistory(str(path)), None


def check_text(text: str) -> None:
    """Refuse input that is not UTF-8: a terminal in another encoding (latin-1's "é")
    reaches Python as surrogate escapes, which no tokenizer takes and no file holds
    (every message failed with the tokenizer's own words, and /save ended the chat)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError("the input is not UTF-8 text", "set the terminal's encoding to UTF-8") from None


def block_text(first: str, lines: list[str]) -> str:
    """The message of a \"\"\" block: its lines without the markers and outer blank lines."""
    return "\n".join([first, *lines]).strip("\n")


class ChatRepl:
    def __init__(self, conversation: Conversation, history_path: Path) -> None:
        self.conversation = conversation
        self.history, problem = open_history(history_path)
        if problem:
            conversation.renderer.warn(problem)
        completer = SlashCompleter(conversation.chats_dir, conversation.adapters)
        self.prompt = PromptSession(history=self.history, completer=completer, complete_while_typing=False)
        # Lines inside a block stay out of the history; the whole block goes in once.
        self.continuation = PromptSession(history=InMemoryHistory())

    def run(self) -> None:
        """Prompt, answer, repeat, until Ctrl-D or /quit."""
        renderer = self.conversation.renderer
        with terminal_restored_on_sigterm():
            while True:
                try:
                    text, typed_line = self.read_message()
                except KeyboardInterrupt:
                    continue
                except EOFError:
                    break
                if text.strip() and self.handle(text, command=typed_line) is Action.QUIT:
                    break
        renderer.info("Goodbye.")

    def handle(self, text: str, command: bool = True) -> Action:
        """A slash command (`command`: the text came as one typed line) or a message."""
        renderer = self.conversation.renderer
        try:
            check_text(text)
            if command and is_command(text):
                return run_command(self.conversation, text)
            self.conversation.send(text.strip())
        except RuvllmError as error:
            renderer.error(error.message, error.hint)
        except OSError as error:   # the file system under a command (a path it cannot use)
            renderer.error(f"{error.strerror or error}{f': {error.filename}' if error.filename else ''}")
        except KeyboardInterrupt:
            renderer.warn("interrupted")
        return Action.CONTINUE

    def read_message(self) -> tuple[str, bool]:
        """One message: a line, or the lines of a \"\"\" block (pastes arrive whole); and
        whether it was one typed line, which may be a slash command (a block or a
        multi-line paste is a message even where it starts with "/")."""
        line = self.prompt.prompt(PROMPT)
        if not line.strip().startswith(BLOCK):
            return line, "\n" not in line.strip()
        pasted = line.strip()
        if "\n" in pasted:   # a paste is one message even where it starts with """ (a module's docstring)
            whole_block = pasted.endswith(BLOCK) and len(pasted) >= 2 * len(BLOCK)
            return (block_text(pasted[len(BLOCK):-len(BLOCK)], []) if whole_block else pasted), False
        first = line.strip()[len(BLOCK):]
        if first.rstrip().endswith(BLOCK):
            return first.rstrip()[:-len(BLOCK)].strip(), False
        lines: list[str] = []
        while True:
            try:
                current = self.continuation.prompt(CONTINUATION)
            except EOFError:   # Ctrl-D ends the block, as an end of input ends a heredoc, not the chat
                break
            if current.rstrip().endswith(BLOCK):
                lines.append(current.rstrip()[:-len(BLOCK)])
                break
            lines.append(current)
        text = block_text(first, lines)
        self.history.append_string(f"{BLOCK}{first}\n" + "\n".join(lines) + BLOCK)
        return text, False
