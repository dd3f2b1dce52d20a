"""The synthetic vocabulary: real BPE structure (every token the merge of two earlier
ones), deterministic, and a tokenizer that round-trips text with Qwen2's split."""

from __future__ import annotations

import pytest

from ruvllm_cli.testing.synthetic_vocab import byte_alphabet, synthetic_tokenizer, synthetic_vocab

pytest.importorskip("tokenizers")


def test_every_token_is_the_merge_of_two_earlier_ones() -> None:
    vocab, merges = synthetic_vocab(3_000)
    assert sorted(vocab.values()) == list(range(3_000))
    assert [piece for piece, i in sorted(vocab.items(), key=lambda item: item[1])][:256] == byte_alphabet()
    assert len(merges) == 3_000 - 256
    for left, right in merges:
        assert vocab[left] < vocab[left + right] and vocab[right] < vocab[left + right]


def test_the_same_seed_gives_the_same_vocabulary() -> None:
    assert synthetic_vocab(20_000) == synthetic_vocab(20_000)
    assert synthetic_vocab(20_000, seed=1) != synthetic_vocab(20_000)   # past the fixed seed texts
    # a smaller one is the start of a larger one
    small, _ = synthetic_vocab(1_000)
    large, _ = synthetic_vocab(2_000)
    assert small == {piece: i for piece, i in large.items() if i < 1_000}


def test_the_tokenizer_round_trips_text_and_splits_digits() -> None:
    tokenizer = synthetic_tokenizer(5_000)
    for text in ("Hello, world!", 'def f(x):\n    return {"a": x}\n', "héllo wörld — 中文 😀", "", "  \t\n"):
        assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert len(tokenizer.encode("12345").ids) == 5   # Qwen2's pre-tokenizer: one digit a piece
    # merges apply: common words take fewer tokens than bytes
    assert len(tokenizer.encode(" the weather").ids) < len(" the weather")
