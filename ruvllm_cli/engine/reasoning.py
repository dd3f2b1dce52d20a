"""Reasoning ("thinking") in model replies: the text a reasoning model writes between
its family's markers before it answers, split from the answer, whole or as it streams.

DeepSeek-R1 and its distills, QwQ and Qwen3 write `<think> ... </think>`; Magistral
writes `[THINK] ... [/THINK]`. Where the chat template opens the block itself (its
generation prompt ends with `<think>`: DeepSeek-R1, QwQ, Qwen3's thinking-only models)
the reply starts inside it and shows only the end marker; otherwise (Qwen3) a block
counts when the reply opens with it. Text after the end marker is the answer; a
reply that never closes its block is all reasoning. The splitter never takes back
what it gave: a tail that could still become a marker is held until it cannot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, Sequence

from ruvllm_cli.engine.sampling import ReasoningBlock
from ruvllm_cli.errors import UsageError


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str


FORMATS = {f.name: f for f in (ReasoningFormat("think", "<think>", "</think>"),
                               ReasoningFormat("mistral", "[THINK]", "[/THINK]"))}
ALIASES = {"deepseek_r1": "think", "qwen3": "think"}   # vLLM's names for the same markers
PARSER_NAMES = ("auto", "none", *FORMATS, *ALIASES)    # what --reasoning-parser takes


def get_format(name: str) -> ReasoningFormat:
    fmt = FORMATS.get(ALIASES.get(name, name))
    if fmt is None:
        raise UsageError(f"unknown reasoning parser {name!r}", hint=f"known parsers: {', '.join(PARSER_NAMES)}")
    return fmt


def detect_format(chat_template: str | None) -> ReasoningFormat | None:
    """The markers a model's chat template writes or strips from earlier turns, if any:
    the end marker is enough (DeepSeek-R1's first template only strips `...</think>`
    from earlier turns, and its model writes both)."""
    template = chat_template or ""
    return next((fmt for fmt in FORMATS.values() if fmt.end in template), None)


@dataclass(frozen=True)
class Reasoning:
    """A model's reasoning format with its markers' token ids, where each is one token
    (the grammar of a constrained reply waits for the end marker's; reasoning tokens
    are counted up to it)."""

    format: ReasoningFormat
    start_id: int | None = None
    end_id: int | None = None

    @classmethod
    def of(cls, fmt: ReasoningFormat, tokenizer: Any) -> "Reasoning":
        return cls(fmt, _single_token(tokenizer, fmt.start), _single_token(tokenizer, fmt.end))

    @property
    def markers(self) -> tuple[str, str]:
        return self.format.start, self.format.end

    def plan(self, tokenizer: Any, prompt_ids: Sequence[int], constrained: bool,
             continued: str | None = None, budgeted: bool = False, free_text: bool = False) -> "ReplyPlan":
        """Where a reply starts, and the block the engine follows in it where a
        constraint (a JSON schema, a forced tool call) or a thinking budget needs it:
        a constraint waits out the block (from the first token it would write the answer
        inside it, and the reply would be all reasoning), and on a reply that may open
        one (Qwen3) it also lets the first token be the start marker. Where the end
        marker is not one token nothing can follow the block: a constraint holds from
        the first token and the reply is all answer (the model does not reason).
        `continued`: the assistant's text a reply continues (continue_final_message),
        inside the block where it opened one and did not close it. `free_text`: the
        constraint takes any text until it bites (tool_choice auto's calls); it too
        waits out the block, and where it cannot, its free text takes the reasoning
        (a call the model opens while it reasons stays reasoning text where it can)."""
        ends_in = self.prompt_ends_in(tokenizer, prompt_ids) if continued is None else None
        inside = ends_in == "open" if continued is None else \
            continued.rfind(self.format.start) > continued.rfind(self.format.end)
        if ends_in == "closed":
            # The template closed the block itself (Qwen3's enable_thinking false): the
            # reply is the answer, and a constraint holds from its first token (were
            # the model to open a block anyway, the constraint would wait for ever).
            return ReplyPlan(False)
        if self.end_id is None:
            return ReplyPlan(inside and not (constrained and not free_text))
        if not (constrained or budgeted):
            return ReplyPlan(inside)
        return ReplyPlan(inside, ReasoningBlock(self.end_id, self.start_id, inside))

    def prompt_ends_in(self, tokenizer: Any, prompt_ids: Sequence[int]) -> str | None:
        """Which block the prompt leaves the reply in: "open" where inside one (its generation
        prompt ends with the start marker, as DeepSeek-R1's and QwQ's templates write it),
        "closed" where it ends with a closed one (`<think>\n\n</think>\n\n`: no
        reasoning), else None."""
        tail = tokenizer.decode(list(prompt_ids[-8:]), skip_special_tokens=False).rstrip()
        return "open" if tail.endswith(self.format.start) else "closed" if tail.endswith(self.format.end) else None

    def splitter(self, in_reasoning: bool) -> "ReasoningSplitter":
        return ReasoningSplitter(self.format, in_reasoning)

    def reasoning_tokens(self, token_ids: Sequence[int], had_reasoning: bool) -> int | None:
        """Tokens of a reply spent reasoning (its end marker included), or None where the
        end marker is not one token and so cannot be found among them."""
        if not had_reasoning:
            return 0
        if self.end_id is None:
            return None
        return token_ids.index(self.end_id) + 1 if self.end_id in token_ids else len(token_ids)


def model_reasoning(tokenizer: Any, name: str = "auto") -> Reasoning | None:
    """The named reasoning markers ("none": none), else ("auto") those the model's chat
    template writes; None for a model that does not reason."""
    if name == "none":
        return None
    fmt = detect_format(getattr(tokenizer, "chat_template", None)) if name == "auto" else get_format(name)
    return Reasoning.of(fmt, tokenizer) if fmt is not None else None


@dataclass(frozen=True)
class ReplyPlan:
    inside: bool                              # the reply starts inside its reasoning block
    block: ReasoningBlock | None = None       # SamplingParams.reasoning_block

    def sampling(self, params: Any, reasoning: Reasoning) -> Any:
        """`params` (SamplingParams or the server's SamplingFields) for this reply."""
        return replace(params, reasoning_block=self.block,
                       kept_special_tokens=(*params.kept_special_tokens, *reasoning.markers))


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class _State(enum.Enum):
    OPENING = "opening"       # before the reply's first text: a block may open here
    REASONING = "reasoning"
    CLOSED = "closed"         # just past the end marker: whitespace before the answer is dropped
    CONTENT = "content"


@dataclass(frozen=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Decoded text in (any number of characters, cut anywhere), the new reasoning and
    content out. Reasoning comes without its surrounding whitespace, the answer without
    the whitespace that follows the end marker, so that a reply streamed and the same
    reply whole give the same two texts."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool) -> None:
        self.format = fmt
        self._state = _State.REASONING if in_reasoning else _State.OPENING
        self._held = ""               # text not yet given out
        self._space = ""              # reasoning's trailing whitespace, given out when more reasoning follows
        self._given_reasoning = False
        self._may_reopen = in_reasoning   # a model may write the start marker the prompt already wrote
        self.had_reasoning = in_reasoning

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    def feed(self, text: str) -> Split:
        self._held += text
        return self._advance(final=False)

    def finish(self) -> Split:
        """The end of the reply: whatever was held back."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> Split:
        reasoning, content = [], []
        while True:
            state = self._state
            if state is _State.OPENING:
                text = self._held.lstrip()
                start = self.format.start
                if text.startswith(start):
                    self._held, self._state, self.had_reasoning = text[len(start):], _State.REASONING, True
                elif (text and not start.startswith(text)) or final:
                    self._state = _State.CONTENT
                else:
                    break   # nothing yet, or a tail that may still become the start marker
            elif state is _State.REASONING and self._may_reopen:
                text, start = self._held.lstrip(), self.format.start
                if text.startswith(start):
                    self._held, self._may_reopen = text[len(start):], False
                elif (text and not start.startswith(text)) or final:
                    self._may_reopen = False
                else:
                    break   # nothing yet, or a tail that may still become the start marker
            elif state is _State.REASONING:
                end = self._held.find(self.format.end)
                if end >= 0:
                    reasoning.append(self._reasoning(self._held[:end], closing=True))
                    self._held, self._state = self._held[end + len(self.format.end):], _State.CLOSED
                    continue
                keep = 0 if final else _marker_prefix(self._held, self.format.end)
                cut = len(self._held) - keep
                reasoning.append(self._reasoning(self._held[:cut], closing=final))
                self._held = self._held[cut:]
                break
            elif state is _State.CLOSED:
                self._held = self._held.lstrip()
                if not self._held:
                    break
                self._state = _State.CONTENT
            else:
                content.append(self._held)
                self._held = ""
                break
        return Split("".join(reasoning), "".join(content))

    def _reasoning(self, text: str, closing: bool) -> str:
        """Reasoning text to give out: its leading whitespace dropped, and trailing
        whitespace held until more follows (dropped at the block's end)."""
        text = self._space + text
        if not self._given_reasoning:
            text = text.lstrip()
        kept = text.rstrip()
        self._space = "" if closing else text[len(kept):]
        self._given_reasoning = self._given_reasoning or bool(kept)
        return kept


def _marker_prefix(text: str, marker: str) -> int:
    """How long a tail of `text` could still grow into `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split_reasoning(fmt: ReasoningFormat, text: str, in_reasoning: bool) -> Split:
    """A whole reply's reasoning and answer."""
    splitter = ReasoningSplitter(fmt, in_reasoning)
    first, rest = splitter.feed(text), splitter.finish()
    return Split(first.reasoning + rest.reasoning, first.content + rest.content)
