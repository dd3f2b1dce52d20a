"""Incremental, UTF-8-safe detokenization and stop-string matching for streams."""

from __future__ import annotations

import re
from typing import Any, Sequence

# Prompt tokens kept as left context: some tokenizers (SentencePiece) decode a
# token's leading space differently at the start of a sequence.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one token at a time into text deltas, holding back incomplete characters."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True,
                 kept_special_tokens: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Special tokens skipped one by one where some must stay (a tool-call format's
        # markers reach its parser; <|im_start|> and the like do not reach the reply).
        self.dropped: frozenset[int] | None = None
        if skip_special_tokens and kept_special_tokens:
            kept = set(kept_special_tokens)
            self.dropped = frozenset(index for index, token in tokenizer.added_tokens_decoder.items()
                                     if token.special and token.content not in kept)
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        if self.dropped is not None:
            return self.tokenizer.decode([i for i in ids if i not in self.dropped], skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence, or nothing visible yet
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """At the end of a reply: the text still held back (an incomplete character
        decodes to U+FFFD, as tokenizer.decode would show it)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""


class StopMatcher:
    """Finds stop strings in the generated text, holding back a tail that could
    still become one, so a stream never shows part of a stop string. With a `fence`
    (a regular expression: where a tool call opens) the stop strings apply to the
    text before its first match only, as OpenAI's stop never cuts a call."""

    FENCE_LOOKBACK = 64   # characters of earlier text a fence's match may start in

    def __init__(self, stop: Sequence[str], fence: str | None = None) -> None:
        self.stop = tuple(stop)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.fence = re.compile(fence) if fence is not None and self.stop else None
        self.text = ""
        self.emitted = 0
        self.written = 0   # characters fed, a stop string and what followed it in its delta included
        self.stopped = False
        self.matched: str | None = None   # the stop string that ended the text (the earliest found)

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit now, whether a stop string was hit).
        After a hit the text is final: later deltas are ignored."""
        if self.stopped:
            return "", True
        before = len(self.text)
        self.text += delta
        self.written += len(delta)
        if not self.stop:
            return self._emit(len(self.text)), False
        fence = self.fence.search(self.text, max(0, before - self.FENCE_LOOKBACK)) if self.fence else None
        limit = fence.start() if fence is not None else len(self.text)
        search_from = max(0, self.emitted - self.longest)
        hits = [(at, s) for s, at in ((s, self.text.find(s, search_from, limit)) for s in self.stop) if at >= 0]
        if fence is not None and not hits:   # a call opened: no stop string applies from here on
            self.stop, self.longest, self.fence = (), 0, None
            return self._emit(len(self.text)), False
        if hits:
            end, self.matched = min(hits, key=lambda hit: hit[0])   # a tie: the first listed
            self.text = self.text[:end]
            self.stopped = True
            return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self._partial_tail()), False

    def flush(self) -> str:
        """At the end of the stream the held-back tail is plain text."""
        if self.stopped:
            return ""
        return self._emit(len(self.text))

    def _partial_tail(self) -> int:
        for size in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0

    def _emit(self, end: int) -> str:
        end = max(end, self.emitted)
        piece = self.text[self.emitted:end]
        self.emitted = end
        return piece
