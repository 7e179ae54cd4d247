"""An HTTP request's JSON body read within the public edge's limits: size, read time, charset, nesting, valid text;
and the JSON written back, which holds no NaN or Infinity.

Each way a body can be wrong is an ApiError with its own status (408, 413, 415 or 400), so a
client never sees a 500 for what it sent. The nesting depth is checked on the text before
`json.loads` sees it, by counting brackets outside strings (numpy), so a deep body never
recurses; no check loops in Python over a body's bytes or over a long array's items, so a
body at the size limit costs about what parsing it does.
"""

from __future__ import annotations

import asyncio
import functools
import json
import operator
import re
import sys
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate, compress, repeat
from typing import Any

from aiohttp import web

from common.cpus import usable_cpus
from common.defaults import HTTP_MAX_BODY_BYTES, HTTP_READ_TIMEOUT_S
from common.json_depth import nests_deeper_than
from gateway.api_error import ApiError

# Where a request keeps its caller's tenant once its API key is checked (gateway/access.py), for the routes to read.
TENANT = web.RequestKey("specserve.tenant", str)
MAX_JSON_DEPTH = 64  # an OpenAI body nests 4 deep (messages[i].content[j].text)

_SURROGATE = re.compile("[\ud800-\udfff]")  # only a JSON escape (or an escaping charset) can make one
# An escape of one (pairs too). Searched apart from _SURROGATE: a regex of either runs 10x slower than both.
_ESCAPED_SURROGATE = re.compile("\\\\u[dD][89a-fA-F]")
_PARSE_INLINE_BYTES = 256 * 1024  # a smaller body is parsed on the event loop (a millisecond or two)
_parsing = asyncio.Semaphore(
    usable_cpus()
)  # large bodies parsed at once; the others wait (their memory is read already)
_MAX_WALKED_CONTAINERS = 10_000  # to name the field holding a lone surrogate; past it, the top-level key
_SCAN_FROM_ITEMS = 64  # an array longer than this is scanned at C speed for strings and containers


# Every JSON reply is written by this: a float that is not finite raises (ValueError, a 500 at worst) instead of being
# written as NaN or Infinity, which are not JSON and which a strict client cannot read (gateway/openai_logprobs.py
# writes a log-probability of -inf as LOGPROB_FLOOR, so none reaches it).
reply_json = functools.partial(json.dumps, allow_nan=False)


@dataclass(frozen=True)
class BodyLimits:
    max_body_bytes: int = HTTP_MAX_BODY_BYTES
    read_timeout_s: float = HTTP_READ_TIMEOUT_S  # from the handler's start to the body's last byte
    max_json_depth: int = MAX_JSON_DEPTH


async def json_body(request: web.Request, limits: BodyLimits) -> dict[str, Any]:
    """The body as a JSON object; raises ApiError naming what is wrong with it.

    A large body is parsed in a thread: each step of it (decoding, counting brackets, json.loads) holds the GIL for
    tens of milliseconds at most, and between them the event loop runs, so other streams go on meanwhile."""
    raw = await _read(request, limits)
    if len(raw) < _PARSE_INLINE_BYTES:
        return parsed(raw, request.charset, limits)
    async with _parsing:
        return await asyncio.to_thread(parsed, raw, request.charset, limits)


def parsed(raw: bytes | bytearray, charset: str | None, limits: BodyLimits) -> dict[str, Any]:
    text = decoded(raw, charset)
    check_depth(text, limits.max_json_depth)
    try:
        body = json.loads(text)
    except json.JSONDecodeError as error:
        raise ApiError(400, f"the body is not valid JSON: {error}") from error
    except ValueError as error:  # an integer literal longer than int() reads
        raise ApiError(400, f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits") from error
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if _ESCAPED_SURROGATE.search(text) or (not text.isascii() and _SURROGATE.search(text)):  # most bodies do not
        check_text(body)
    return body


async def _read(request: web.Request, limits: BodyLimits) -> bytearray:
    too_large = ApiError(
        413, f"the body is larger than {limits.max_body_bytes} bytes (see --http-max-body-bytes)", code="body_too_large"
    )
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise too_large  # refused before a byte of it is read
    # Read here rather than by request.read(), which keeps a copy on the request: aiohttp holds a keep-alive
    # connection's last request until the next one comes, and with it the largest body it was sent.
    body = bytearray()
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            async for chunk in request.content.iter_any():
                body += chunk
                if len(body) > limits.max_body_bytes:  # a chunked body, or one longer than its Content-Length said
                    raise too_large
            return body
    except TimeoutError as error:
        raise ApiError(
            408,
            f"the body was not received within {limits.read_timeout_s} s (see --http-read-timeout-s)",
            code="body_timeout",
        ) from error
    except web.HTTPRequestEntityTooLarge as error:
        raise too_large from error


def decoded(raw: bytes | bytearray, charset: str | None) -> str:
    """The body as text in its Content-Type's charset (UTF-8 when it names none)."""
    encoding = charset or "utf-8"
    try:
        return raw.decode(encoding)
    except (LookupError, ValueError) as error:  # ValueError: a name Python cannot look up at all (a NUL in it)
        if isinstance(error, UnicodeError):
            raise ApiError(400, f"the body is not valid {encoding}: {error}") from error
        raise ApiError(
            415,
            f"the charset {encoding!r} in Content-Type is not a known text encoding (send UTF-8)",
            code="unsupported_charset",
        ) from error


def check_depth(text: str, max_depth: int) -> None:
    """Raises ApiError if arrays and objects nest deeper than max_depth; brackets inside strings do not count (counted
    without recursing: common/json_depth.py)."""
    if nests_deeper_than(text, max_depth):
        raise ApiError(400, f"the body nests arrays and objects deeper than {max_depth} levels", code="body_too_deep")


def check_text(body: dict[str, Any]) -> None:
    """Raises ApiError naming a string (a value or a key) that holds a lone UTF-16 surrogate, which no tokenizer
    can encode. Whether there is one is asked of the body re-encoded, at C speed; then the field is named by a
    walk of at most _MAX_WALKED_CONTAINERS arrays and objects, else by the body's top-level key."""
    if not _SURROGATE.search(json.dumps(body, ensure_ascii=False)):
        return
    _walk_to_surrogate(body)
    if len(body) <= _MAX_WALKED_CONTAINERS and not _SURROGATE.search("".join(body)):
        raise _surrogate_in(
            next(key for key, value in body.items() if _SURROGATE.search(json.dumps(value, ensure_ascii=False)))
        )
    raise ApiError(400, "the body holds a lone surrogate (\\ud800-\\udfff), which is not a character")


def _walk_to_surrogate(body: dict[str, Any]) -> None:
    """Raises ApiError naming the string that holds a lone surrogate, each container's own strings first, then what
    it nests, with a stack of its own; returns if it finds none within _MAX_WALKED_CONTAINERS containers."""
    pending: list[tuple[str, object]] = [("", body)]
    for _ in range(_MAX_WALKED_CONTAINERS):
        if not pending:
            return
        path, value = pending.pop()
        if isinstance(value, dict):
            if _SURROGATE.search("".join(value)):
                raise ApiError(
                    400, f"a key in {path or 'the body'} holds a lone surrogate (\\ud800-\\udfff)", path or None
                )
            children = [(f"{path}.{key}" if path else key, item) for key, item in value.items()]
        elif isinstance(value, list) and len(value) > _SCAN_FROM_ITEMS:
            bad, containers = _scan(value)
            if bad is not None:
                raise _surrogate_in(f"{path}[{bad}]")
            children = [(f"{path}[{index}]", value[index]) for index in containers]
        elif isinstance(value, list):
            children = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
        nested: list[tuple[str, object]] = []
        for name, item in children:
            if isinstance(item, str):
                if _SURROGATE.search(item):
                    raise _surrogate_in(name)
            elif isinstance(item, (dict, list)):
                nested.append((name, item))
        pending.extend(reversed(nested))


def _surrogate_in(name: str) -> ApiError:
    return ApiError(400, f"{name} holds a lone surrogate (\\ud800-\\udfff), which is not a character", name)


def _scan(items: list[object]) -> tuple[int | None, list[int]]:
    """The index of the first string among items that holds a lone surrogate (None when none does) and the
    indexes of the arrays and objects, found without a Python loop over items (one may be millions of token ids)."""
    kinds = list(map(type, items))  # what json.loads makes: exactly str, dict, list, int, ...
    is_string = list(map(operator.is_, kinds, repeat(str)))
    strings: list[str] = list(compress(items, is_string))  # type: ignore[arg-type]
    found = _SURROGATE.search("".join(strings))  # a pair is one character: a surrogate here is alone
    bad = None
    if found:
        ends = list(accumulate(map(len, strings)))  # string k is "".join(strings)[ends[k-1]:ends[k]]
        bad = list(compress(range(len(items)), is_string))[bisect_right(ends, found.start())]
    containers = [
        index
        for kind in (dict, list)
        if kind in kinds
        for index in compress(range(len(items)), map(operator.is_, kinds, repeat(kind)))
    ]
    return bad, sorted(containers)
