"""A request body from bytes to JSON the handlers can trust: within the size cap,
parseable, not nested absurdly deep, and with no string a UTF-8 encoder would choke on
(a lone surrogate). Each refusal is a 4xx naming its param."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Iterator, NoReturn

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

from ruvllm_cli.server.errors import ApiError, bad_request

# Far deeper than any OpenAI request (a JSON schema of 20 nested objects is ~60 levels)
# and far below Python's recursion limit, which later consumers (templates) share.
MAX_DEPTH = 128
# A lone surrogate (a "\ud800" escape with no partner) cannot be encoded as UTF-8 at all,
# so no tokenizer or reply can carry it. NUL is text like any other: byte-level vocabularies
# have a token for it, so a model's reply can hold one and the next turn sends it back
# (it had been refused, which broke such a chat); a string that names a file refuses it
# where it is read (`no_nul`), as the OS would.
_BAD_CHAR = re.compile("[\ud800-\udfff]")


async def read_json(request: web.Request, max_size: int) -> Any:
    """The body as checked JSON: 413 beyond `max_size` bytes, 400 when it does not parse
    or holds a string we refuse, 408 when it has not all arrived within the server's
    idle timeout (a client trickling its body must not hold a handler for ever)."""
    if request.content_length is not None and request.content_length > max_size:
        raise ApiError(413, f"The request body is too large: {request.content_length} bytes, the limit is "
                            f"{max_size} bytes.", code="request_too_large")
    # The connection's keep-alive timeout is the server's idle timeout (app.start_server):
    # the time a connection has to deliver a whole request.
    timeout = getattr(request.protocol, "keepalive_timeout", None) or None
    try:
        # aiohttp enforces the cap on chunked bodies (HTTPRequestEntityTooLarge)
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"The request body did not arrive within {timeout:g} s.", code="request_timeout",
                       close=True) from None
    except (RequestPayloadError, ContentEncodingError) as error:
        # A body aiohttp could not decode (a Content-Encoding the data does not match): the
        # client's fault. The rest of it is not read: the connection closes after the answer.
        encoding = request.headers.get("Content-Encoding", "")
        raise ApiError(400, f"The request body could not be decoded as its Content-Encoding ({encoding or 'none'}) "
                            "says.", code="invalid_body", close=True) from error
    body = parse_json(raw)
    check_json(body)
    return body


def parse_json(raw: bytes) -> Any:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return json.loads(raw)
    except RecursionError as error:
        raise _too_deep() from error
    except (ValueError, UnicodeDecodeError) as error:
        # Python's own advice (sys.set_int_max_str_digits) is not for an API client.
        detail = "a number has more digits than the 4300 we read" if "int_max_str_digits" in str(error) else error
        raise bad_request(f"We could not parse the JSON body of your request: {detail}", code="invalid_json") \
            from error


def check_json(body: Any) -> None:
    """Every string (keys included) free of lone surrogates, at most MAX_DEPTH
    levels; the param named is the path of the offending value, e.g. `messages[0].content`."""
    if isinstance(body, str):
        _check_string(None, body)
    # A plain loop over each container, building no paths: a 4 MB body can hold a
    # million values, and this runs on the event loop. Paths only for the error.
    pending: list[tuple[Any, int]] = [(body, 0)] if isinstance(body, (dict, list)) else []
    while pending:
        value, depth = pending.pop()
        if depth >= MAX_DEPTH:
            raise _too_deep()
        if isinstance(value, dict) and any(_BAD_CHAR.search(key) for key in value):
            _report(body)
        for item in value.values() if isinstance(value, dict) else value:
            kind = type(item)
            if kind is str:
                if _BAD_CHAR.search(item):
                    _report(body)
            elif kind is dict or kind is list:
                pending.append((item, depth + 1))


def _too_deep() -> ApiError:
    return bad_request(f"The JSON body is nested too deeply (at most {MAX_DEPTH} levels).", code="invalid_json")


def _report(body: Any) -> NoReturn:
    """Raise the 400 for the first bad string in `body`, naming its path."""
    for path, value in _paths(body):
        if isinstance(value, dict):
            for key in value:
                _check_string(path, key, "a key of ")
        elif isinstance(value, str):
            _check_string(path, value)
    raise AssertionError("_report found no bad string")


def _paths(body: Any) -> Iterator[tuple[str | None, Any]]:
    """(param path, value) of every value in `body`, without recursion."""
    pending: list[tuple[str | None, Any]] = [(None, body)]
    while pending:
        path, value = pending.pop()
        yield path, value
        if isinstance(value, dict):
            pending.extend((f"{path}.{key}" if path else key, item) for key, item in value.items())
        elif isinstance(value, list):
            pending.extend((f"{path or ''}[{i}]", item) for i, item in enumerate(value))


def _check_string(path: str | None, text: str, what: str = "") -> None:
    found = _BAD_CHAR.search(text)
    if found is None:
        return
    where = f"'{path}'" if path else "the body"
    raise bad_request(f"Invalid value in {what}{where}: text must not contain a lone UTF-16 surrogate "
                      f"(at offset {found.start()}).", path, "invalid_value")


def no_nul(param: str, text: str) -> str:
    """`text` where it names an adapter or a file (a path, a hub id): a 400 for a NUL,
    which no file name holds (and which Python's os calls raise ValueError on)."""
    offset = text.find("\x00")
    if offset >= 0:
        raise bad_request(f"Invalid value in '{param}': a name or path must not contain a NUL character "
                          f"(at offset {offset}).", param, "invalid_value")
    return text
