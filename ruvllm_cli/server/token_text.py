"""Each token's own text and raw bytes, for logprobs.

A byte-level BPE token can be part of a UTF-8 character, so its text alone loses
information; OpenAI's `bytes` field carries the exact bytes, which we recover from
the tokenizer's byte-to-unicode alphabet (GPT-2 style) or `<0xNN>` byte tokens
(SentencePiece style)."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTexts:
    """Caches (text, bytes) per token id; the tokenizer is only read."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self._special = set(getattr(tokenizer, "all_special_tokens", ()))

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self.lookup(token_id)[1]

    def lookup(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", []
        raw = self._raw_bytes(piece)
        if raw is None:
            text = self._tokenizer.decode([token_id])
            return text, list(text.encode("utf-8"))
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _raw_bytes(self, piece: str) -> bytes | None:
        if piece in self._special:
            return piece.encode("utf-8")
        match = _BYTE_TOKEN.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        table = _unicode_to_byte()
        if not self._byte_level or not all(ch in table for ch in piece):
            return None   # not a byte-level token: let the tokenizer decode it
        return bytes(table[ch] for ch in piece)
