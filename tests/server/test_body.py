"""The JSON body checks on their own: which string is refused, under which param."""

from __future__ import annotations

import pytest

from ruvllm_cli.server.body import MAX_DEPTH, check_json, parse_json
from ruvllm_cli.server.errors import ApiError


@pytest.mark.parametrize("body, param, message", [
    ({"a": [{"b": "x\x00"}]}, "a[0].b", "Invalid value in 'a[0].b': text must not contain a NUL character "
                                         "(at offset 1)."),
    ({"a": ["ok", "\udc80"]}, "a[1]", "Invalid value in 'a[1]': text must not contain a lone UTF-16 surrogate "
                                       "(at offset 0)."),
    ({"a": {"\ud800": 1}}, "a", "Invalid value in a key of 'a': text must not contain a lone UTF-16 surrogate"),
    ({"\x00": 1}, None, "Invalid value in a key of the body: text must not contain a NUL character"),
    ("\ud800", None, "Invalid value in the body"),
])
def test_a_bad_string_is_refused_under_its_path(body, param, message):
    with pytest.raises(ApiError) as refused:
        check_json(body)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, "invalid_value")
    assert refused.value.message.startswith(message)


def test_paired_surrogates_and_plain_text_pass():
    check_json(parse_json(b'{"content": "\\ud83d\\ude00 caf\\u00e9", "ids": [1, 2.5, null, true]}'))


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
