"""A synthetic byte-level BPE vocabulary of Qwen2.5's size (151,643 regular tokens),
built offline in about 2 s: no real tokenizer can be downloaded here, and a model's
vocabulary weighs in what a benchmark measures (its parse holds tens of MiB; a grammar
library indexes every token).

Every token is the merge of two earlier ones, as in real BPE, and the tokens look like
a real vocabulary's: space-prefixed words, CJK, code, indentation and punctuation runs
such as `{"` and `":"`; digits stay single tokens, as Qwen2's pre-tokenizer splits them.
The bench model's tokenizer (`tiny_model.build_bench_model`) and
`scripts/bench_grammar.py` use it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

REGULAR_TOKENS = 151_643   # Qwen2.5's tokens before its added ones
# Qwen2's pre-tokenizer split (from its tokenizer.json).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")

ONSETS = "b c d f g h j k l m n p r s t v w z ch sh th st tr pl br cr gr sp qu".split()
VOWELS = "a e i o u y ea ou io ai ee oo".split()
SUFFIXES = ["", "", "", "s", "ed", "ing", "ly", "er", "tion", "ment", "al", "ness"]
PUNCTUATION = '{}[]()"\',:;.!?<>=+-*/\\|&%$#@~`_^'


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


class VocabBuilder:
    """A BPE vocabulary grown so that every token is the merge of two earlier ones, and
    each added text encodes (with the merges so far) to one token, as in real BPE."""

    def __init__(self, alphabet: list[str]) -> None:
        self.symbols = alphabet
        self.vocab = {symbol: i for i, symbol in enumerate(alphabet)}
        self.ranks: dict[tuple[str, str], int] = {}

    def add_text(self, text: str) -> None:
        parts = self.encode("".join(self.symbols[b] for b in text.encode("utf-8")))
        while len(parts) > 1:  # merge neighbours pairwise, round by round
            parts = [self.merge(*parts[i:i + 2]) if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]

    def merge(self, left: str, right: str) -> str:
        self.ranks.setdefault((left, right), len(self.ranks))
        self.vocab.setdefault(left + right, len(self.vocab))
        return left + right

    def encode(self, piece: str) -> list[str]:
        """BPE: merge the lowest-ranked neighbouring pair until none is known."""
        parts = list(piece)
        while len(parts) > 1:
            ranked = [(self.ranks.get(pair, len(self.ranks)), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, i = min(ranked)
            if rank == len(self.ranks):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def truncated(self, size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """The first `size` tokens and the merges that make them: later tokens only
        ever build on earlier ones."""
        vocab = {piece: i for piece, i in self.vocab.items() if i < size}
        merges = sorted((pair for pair in self.ranks if self.vocab[pair[0] + pair[1]] < size), key=self.ranks.get)
        return vocab, merges


def word(rng: random.Random) -> str:
    syllables = rng.choices([1, 2, 3, 4], weights=[4, 6, 2, 1])[0]
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(syllables)) + rng.choice(SUFFIXES)


def cased(rng: random.Random, text: str) -> str:
    form = rng.choices(["lower", "title", "upper"], weights=[12, 5, 1])[0]
    text = text.title() if form == "title" else text.upper() if form == "upper" else text
    return (" " if rng.random() < 0.7 else "") + text


def cjk(rng: random.Random) -> str:
    return "".join(chr(rng.randint(0x4E00, 0x7FFF)) for _ in range(rng.choices([1, 2, 3], weights=[5, 4, 1])[0]))


def code(rng: random.Random) -> str:
    name = "_".join(word(rng) for _ in range(rng.choice([1, 1, 1, 2])))
    return rng.choice(["_", ".", "", "", " self.", "(", "__"]) + name + rng.choice(["", "", "(", "()", "=", "_"])


def punctuation(rng: random.Random) -> str:
    text = "".join(rng.choice(PUNCTUATION) for _ in range(rng.choice([2, 2, 3, 4])))
    return (" " if rng.random() < 0.3 else "") + text + ("\n" if rng.random() < 0.1 else "")


def spacing(rng: random.Random) -> str:
    return rng.choice(["\n", "\n\n", "\r\n", ""]) + rng.choice([" ", "\t"]) * rng.randint(1, 16)


def accented(rng: random.Random) -> str:
    letters = "àáâäçèéêëìíîïñòóôöùúûüßøåæ" "абвгдежзийклмнопрстуфхцчшщыэюя"
    return " " * (rng.random() < 0.7) + "".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))


def candidates(rng: random.Random) -> Iterator[str]:
    kinds: list[Callable[[random.Random], str]] = [
        lambda r: cased(r, word(r)), cjk, code, punctuation, accented, spacing]
    while True:
        yield rng.choices(kinds, weights=[56, 18, 10, 8, 6, 2])[0](rng)


def seed_texts() -> list[str]:
    """What every real BPE vocabulary has early: letter pairs, space + character, JSON
    punctuation runs, and common English words."""
    import re
    import string

    from ruvllm_cli.testing.tiny_model import CORPUS

    pairs = [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]
    spaced = [" " + c for c in string.ascii_letters + string.digits + string.punctuation]
    json_runs = ['{"', '":', '",', '"}', '":"', '","', '"},', '"},{"', '}}', ']}', '":[', '":{', '[{"', ' {"']
    words = sorted(set(re.findall(r"[A-Za-z]+", CORPUS)))
    return pairs + spaced + json_runs + [w for word in words for w in (word, " " + word, " " + word.title())]


def synthetic_vocab(size: int = REGULAR_TOKENS, seed: int = 0) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """`size` tokens (at least the 256 bytes) and the merges that make them; the same
    arguments give the same vocabulary."""
    builder = VocabBuilder(byte_alphabet())
    for text in seed_texts():
        builder.add_text(text)
    stream = candidates(random.Random(seed))
    while len(builder.vocab) < size:
        builder.add_text(next(stream))
    return builder.truncated(size)


def synthetic_tokenizer(size: int = REGULAR_TOKENS, seed: int = 0) -> "Tokenizer":
    """A `tokenizers` BPE of `synthetic_vocab(size, seed)` with Qwen2's split and
    byte-level pre-tokenizer and decoder; no added tokens yet."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = synthetic_vocab(size, seed)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend
