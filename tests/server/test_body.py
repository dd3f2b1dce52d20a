"""The JSON body checks on their own: which string is refused, under which param."""

from __future__ import annotations

import pytest

from ruvllm_cli.server.body import MAX_DEPTH, check_json, no_nul, parse_json
from ruvllm_cli.server.errors import ApiError


@pytest.mark.parametrize("body, param, message", [
    ({"a": [{"b": "x\udfff"}]}, "a[0].b", "Invalid value in 'a[0].b': text must not contain a lone UTF-16 "
                                           "surrogate (at offset 1)."),
    ({"a": ["ok", "\udc80"]}, "a[1]", "Invalid value in 'a[1]': text must not contain a lone UTF-16 surrogate "
                                       "(at offset 0)."),
    ({"a": {"\ud800": 1}}, "a", "Invalid value in a key of 'a': text must not contain a lone UTF-16 surrogate"),
    ({"\udc00": 1}, None, "Invalid value in a key of the body: text must not contain a lone UTF-16 surrogate"),
    ("\ud800", None, "Invalid value in the body"),
])
def test_a_bad_string_is_refused_under_its_path(body, param, message):
    with pytest.raises(ApiError) as refused:
        check_json(body)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, "invalid_value")
    assert refused.value.message.startswith(message)


def test_paired_surrogates_nul_and_plain_text_pass():
    """NUL is text: a byte-level vocabulary's reply can hold one, and the next turn sends it back."""
    check_json(parse_json(b'{"content": "\\ud83d\\ude00 caf\\u00e9 a\\u0000b", "\\u0000": 1, '
                          b'"ids": [1, 2.5, null, true]}'))


def test_a_path_refuses_nul_under_its_param():
    assert no_nul("lora_path", "./adapters/sql") == "./adapters/sql"
    with pytest.raises(ApiError) as refused:
        no_nul("lora_path", "./adapters\x00/sql")
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, "lora_path", "invalid_value")
    assert refused.value.message == ("Invalid value in 'lora_path': a name or path must not contain a NUL "
                                     "character (at offset 10).")


def nested(depth: int) -> list:
    body: list = []
    for _ in range(depth - 1):
        body = [body]
    return body


def test_nesting_is_capped_at_max_depth():
    check_json(nested(MAX_DEPTH))
    with pytest.raises(ApiError, match="nested too deeply"):
        check_json(nested(MAX_DEPTH + 1))
    with pytest.raises(ApiError, match="nested too deeply"):
        parse_json(b"[" * 100_000 + b"]" * 100_000)
