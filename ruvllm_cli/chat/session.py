"""Conversation state: messages, system prompt, sampling settings, token counts
through the model's chat template, context-window trimming, and chat files.

No terminal and no torch here: the template is any callable that renders messages
to token ids, so tests can use the tiny model's tokenizer alone.
"""

from __future__ import annotations

import dataclasses
import json
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ruvllm_cli.engine.chat_template import render_chat
from ruvllm_cli.engine.sampling import MAX_TEMPERATURE, SamplingKnobs, SamplingParams
from ruvllm_cli.fsutil import write_text_atomic
from ruvllm_cli.errors import ModelLoadError, RuvllmError, UsageError

if TYPE_CHECKING:
    from ruvllm_cli.engine.grammar import GrammarSpec

# messages (role/content dicts), add_generation_prompt -> token ids
TemplateRenderer = Callable[[list[dict[str, str]], bool], list[int]]

FILE_FORMAT = "ruvllm-chat"
FILE_VERSION = 1
# Warn once the conversation fills this share of the tokens it may use.
WARN_FRACTION = 0.8
ROLES = ("user", "assistant")


class ChatTemplate:
    """Renders messages to token ids with the tokenizer's own chat template."""

    def __init__(self, tokenizer: Any, kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ModelLoadError("this model's tokenizer has no chat template",
                                 "chat needs an instruct/chat model; base models only continue text")
        self.tokenizer = tokenizer
        self.kwargs = kwargs   # the template's own variables (enable_thinking)

    def __call__(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        if not messages:
            return []
        return render_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                           template_kwargs=self.kwargs)


# ---------------------------------------------------------------- sampling settings

PARAM_ALIASES = {"temp": "temperature", "max": "max_tokens", "repeat_penalty": "repetition_penalty",
                 "presence": "presence_penalty", "frequency": "frequency_penalty"}


@dataclass(frozen=True)
class ChatSettings(SamplingKnobs):
    """The sampling parameters of every reply (what /temp, /max and /set change)."""

    temperature: float = 0.7
    max_tokens: int = 512

    def __post_init__(self) -> None:
        self.sampling_params()  # validates every field, with the parameter's name in the message
        if self.temperature > MAX_TEMPERATURE:   # the engine takes more (Ollama's options)
            raise UsageError(f"temperature must be between 0 and {MAX_TEMPERATURE:g} (got {self.temperature})")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**dataclasses.asdict(self))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "ChatSettings":
        """A copy with `changes` applied; UsageError when a value is out of range."""
        return dataclasses.replace(self, **changes)

    def with_text(self, name: str, text: str) -> "ChatSettings":
        """A copy with parameter `name` parsed from `text` (as typed after /set)."""
        name = canonical_param(name)
        return self.replace(**{name: parse_param(name, text)})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ChatSettings":
        unknown = sorted(set(data) - set(param_names()))
        if unknown:
            raise UsageError(f"unknown parameter {unknown[0]!r}", f"parameters: {', '.join(param_names())}")
        values = {name: _coerce(name, value) for name, value in data.items()}
        return cls(**values)


def param_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ChatSettings)]


def canonical_param(name: str) -> str:
    """`top-p`, `TOP_P` -> `top_p`; `temp` -> `temperature`; UsageError with a suggestion."""
    key = name.strip().lower().replace("-", "_")
    key = PARAM_ALIASES.get(key, key)
    if key in param_names():
        return key
    import difflib

    close = difflib.get_close_matches(key, param_names(), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise UsageError(f"unknown parameter {name!r}", f"{hint}parameters: {', '.join(param_names())}")


def parse_param(name: str, text: str) -> int | float | None:
    """The typed value of parameter `name` from user text."""
    text = text.strip()
    if name == "seed" and text.lower() in ("none", "off", "random"):
        return None
    kind = int if name in ("max_tokens", "top_k", "seed") else float
    try:
        return kind(text)
    except ValueError:
        noun = "a whole number" if kind is int else "a number"
        raise UsageError(f"{name} must be {noun} (got {text!r})") from None


def _coerce(name: str, value: Any) -> int | float | None:
    if value is None and name == "seed":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"parameter {name} must be a number (got {value!r})")
    return parse_param(name, str(value))


# ---------------------------------------------------------------- messages

@dataclass
class Message:
    role: str            # "user" | "assistant" (the system prompt is kept apart)
    content: str
    interrupted: bool = False  # an assistant reply stopped with Ctrl-C: partial

    def to_template(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.interrupted:
            data["interrupted"] = True
        return data

    @classmethod
    def from_dict(cls, data: Any) -> "Message":
        if not isinstance(data, Mapping) or data.get("role") not in ROLES \
                or not isinstance(data.get("content"), str):
            raise UsageError(f"a message must have a role ({'/'.join(ROLES)}) and text content; got {data!r:.80}")
        return cls(data["role"], data["content"], bool(data.get("interrupted", False)))


@dataclass(frozen=True)
class FitResult:
    prompt_ids: list[int]
    dropped_turns: int


# ---------------------------------------------------------------- the session

@dataclass
class ChatSession:
    """One conversation with one model."""

    template: TemplateRenderer
    context_limit: int
    model: str = ""
    system_prompt: str | None = None
    settings: ChatSettings = field(default_factory=ChatSettings)
    messages: list[Message] = field(default_factory=list)
    # --json / --json-schema: every reply constrained to it (not a /set knob, not saved).
    structured: "GrammarSpec | None" = None
    # The LoRA adapter replies come from (None: the base model); saved with the settings.
    adapter: str | None = None
    _warned: bool = field(default=False, repr=False)

    def sampling_params(self) -> SamplingParams:
        """The next reply's sampling: the settings, constrained to `structured` when set."""
        return dataclasses.replace(self.settings.sampling_params(), structured=self.structured)

    # ---- rendering and counting ------------------------------------------------
    def template_messages(self, messages: list[Message] | None = None) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [m.to_template() for m in (self.messages if messages is None else messages)]

    def prompt_ids(self) -> list[int]:
        """The whole conversation rendered for the next reply (generation prompt added)."""
        return self.template(self.template_messages(), True)

    def count_tokens(self) -> int:
        """Tokens of the conversation so far, system prompt included, as the model sees it."""
        return len(self.template(self.template_messages(), False))

    def system_prompt_warning(self) -> str | None:
        """A warning when the system prompt alone leaves no room in the context for a
        message and its reply (it had been taken in silence, and every message then
        refused as too long)."""
        if not self.system_prompt:
            return None
        try:
            used = len(self.template(self.template_messages([]), False))
        except RuvllmError:   # a template that renders no conversation without a message
            return None
        if used < self.budget:
            return None
        return (f"the system prompt takes {used} tokens of the {self.context_limit}-token context, with "
                f"{self.reply_reserve} kept for a reply: no message fits (shorten it; /system --clear removes it)")

    @property
    def reply_reserve(self) -> int:
        """Context tokens kept free for the next reply (never more than half the window)."""
        return min(self.settings.max_tokens, self.context_limit // 2)

    @property
    def budget(self) -> int:
        """Tokens the conversation may use before the oldest turns are dropped."""
        return self.context_limit - self.reply_reserve

    # ---- changes -----------------------------------------------------------------
    def add_user(self, text: str) -> None:
        self.messages.append(Message("user", text))

    def add_reply(self, text: str, interrupted: bool = False) -> None:
        self.messages.append(Message("assistant", text, interrupted))

    def drop_last_user(self) -> None:
        """Undo `add_user` after the reply to it failed."""
        if self.messages and self.messages[-1].role == "user":
            self.messages.pop()

    def pop_last_reply(self) -> Message | None:
        """Remove the last reply so it can be generated again (/retry); None where the
        last message is the user's, with no reply yet (a chat saved or edited so): the
        reply is then generated for the first time."""
        if not self.messages:
            raise UsageError("there is no reply to retry yet", "send a message first")
        return self.messages.pop() if self.messages[-1].role == "assistant" else None

    @property
    def awaits_reply(self) -> bool:
        """The last message is the user's, with no reply after it."""
        return bool(self.messages) and self.messages[-1].role == "user"

    def clear(self) -> None:
        """Forget every message; the system prompt and the settings stay."""
        self.messages.clear()
        self._warned = False

    # ---- the context window ----------------------------------------------------------
    def fit_context(self) -> FitResult:
        """The next prompt's ids, after dropping the oldest turns (after the system prompt)
        until the conversation leaves `reply_reserve` tokens free.

        UsageError, with nothing dropped, when the latest message cannot fit even alone."""
        alone = self.template(self.template_messages(self.messages[self._last_turn_start():]), True)
        if len(alone) >= self.context_limit:
            hint = "send a shorter message"
            if self.system_prompt:
                hint += ", or shorten the system prompt (/system --clear removes it)"
            raise UsageError(f"the message needs {len(alone)} tokens with the system prompt; "
                             f"the context limit is {self.context_limit}", hint)
        ids, dropped = self.prompt_ids(), 0
        while len(ids) > self.budget and self._drop_oldest_turn():
            dropped += 1
            ids = self.prompt_ids()
        return FitResult(ids, dropped)

    def context_warning(self) -> str | None:
        """A warning, once each time the conversation nears the end of its budget."""
        used = self.count_tokens()
        if used < WARN_FRACTION * self.budget:
            self._warned = False
            return None
        if self._warned:
            return None
        self._warned = True
        kept = f"(context {self.context_limit}, {self.reply_reserve} kept for the reply)"
        if used > self.budget:   # a reply ran past the room kept for it
            return (f"the conversation uses {used} tokens, past the {self.budget} it may keep {kept}: "
                    "the next message drops its oldest turns")
        return (f"the conversation uses {used} of the {self.budget} tokens it may keep {kept}; "
                "the oldest turns will be dropped when it is full")

    def _user_indices(self) -> list[int]:
        return [i for i, m in enumerate(self.messages) if m.role == "user"]

    def _last_turn_start(self) -> int:
        users = self._user_indices()
        return users[-1] if users else 0

    def _drop_oldest_turn(self) -> bool:
        """Remove the first user message and the replies to it; never the latest turn."""
        users = self._user_indices()
        if len(users) < 2:
            return False
        del self.messages[:users[1]]
        return True

    # ---- files ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FILE_FORMAT, "version": FILE_VERSION, "model": self.model,
            "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "system_prompt": self.system_prompt, "parameters": self.settings.to_dict(),
            "adapter": self.adapter, "messages": [m.to_dict() for m in self.messages],
        }

    def save(self, path: Path) -> None:
        """Write the chat as JSON, atomically (a failed write leaves no half file)."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")

    def load(self, path: Path) -> str:
        """Replace system prompt, parameters, adapter and messages with a saved chat's;
        returns the model it was saved with. Nothing changes when the file is bad. The
        adapter is taken as saved: whether it is loaded is the caller's to check.
        Parameters the file leaves out keep their values (a file without any had reset
        them to the built-in defaults, not the command line's or the model's)."""
        data = read_chat_file(path)
        try:
            parameters = data.get("parameters") or {}
            if not isinstance(parameters, Mapping):
                raise UsageError("parameters must be an object of name: value")
            given = ChatSettings.from_dict(parameters)
            settings = self.settings.replace(**{name: getattr(given, name) for name in parameters})
            if settings.max_tokens > self.context_limit:   # as /max refuses it
                raise UsageError(f"max_tokens {settings.max_tokens} is beyond the model's "
                                 f"{self.context_limit}-token context")
            raw_messages = data.get("messages") or []
            if not isinstance(raw_messages, list):
                raise UsageError("messages must be a list of {\"role\": ..., \"content\": ...} objects")
            messages = [Message.from_dict(m) for m in raw_messages]
            system = data.get("system_prompt")
            if system is not None and not isinstance(system, str):
                raise UsageError("system_prompt must be text")
            adapter = data.get("adapter")
            if adapter is not None and not isinstance(adapter, str):
                raise UsageError("adapter must be an adapter's name or null")
        except UsageError as error:
            raise RuvllmError(f"{path}: {error.message}", error.hint) from None
        self.settings, self.messages, self.system_prompt = settings, messages, system or None
        self.adapter = adapter or None
        self._warned = False
        return str(data.get("model") or "")


# No chat file is this big (a 4,096-token context is about 16 KB of text); a larger one
# is read no further (`/load /dev/zero` had read until the kernel killed the chat).
MAX_CHAT_FILE = 256 * 2**20


def read_chat_file(path: Path) -> dict[str, Any]:
    try:
        found = path.stat()
        if stat.S_ISDIR(found.st_mode):
            raise RuvllmError(f"{path} is a directory, not a chat file", "give a file: /load <file>")
        if not stat.S_ISREG(found.st_mode):   # a FIFO blocked the chat, a device read forever
            raise RuvllmError(f"{path} is not a regular file")
        if found.st_size > MAX_CHAT_FILE:
            raise RuvllmError(f"{path} is {found.st_size / 2**20:.0f} MiB: larger than any chat file")
        data = json.loads(path.read_text(encoding="utf-8"))
        # JSON's \ud800 escapes make lone surrogates, which no tokenizer or file takes:
        # refused here, where they had failed every message and then /save ended the chat.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except FileNotFoundError:
        raise RuvllmError(f"no chat file at {path}") from None
    except UnicodeEncodeError:
        raise RuvllmError(f"{path} holds text that is not Unicode (a lone surrogate escape)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise RuvllmError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    except (json.JSONDecodeError, RecursionError) as error:
        raise RuvllmError(f"{path} is not JSON: {error}") from None
    if not isinstance(data, dict) or data.get("format") != FILE_FORMAT:
        raise RuvllmError(f"{path} is not a ruvllm chat file", "save one with /save")
    version = data.get("version", FILE_VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or version > FILE_VERSION:
        raise RuvllmError(f"{path} is a chat file of version {version!r}; this ruvllm reads up to {FILE_VERSION}",
                          "update ruvllm to load it")
    return data
