"""Request bodies read and parsed without letting one client hurt the others.

* the read has a deadline (a client that trickles its body is answered 408) and a byte limit (413);
* a body over 64 KiB is parsed in a worker thread, not on the event loop, and at most one over 1 MiB at a time, so
  that a large body stalls nobody and the memory of parsing is bounded by one body, not by the number of clients
  sending them;
* what cannot be served is refused with a 400 before or instead of a 500: a body that is not UTF-8, JSON with
  NaN/Infinity, nesting past the parser's recursion limit, integers of more than 4300 digits (Python's limit),
  strings holding a lone UTF-16 surrogate (`"\\ud800"`: no encoder can write it back), and bodies with more JSON
  values than MAX_JSON_VALUES (counted by commas before parsing: a body of millions of one-character strings
  costs gigabytes as Python objects).
"""
from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from k3core.serve.protocol import APIError

MAX_JSON_VALUES = 2_000_000          # commas + 1 in a body; a 1M-token prompt as ids has 1M
INLINE_BODY_BYTES = 64 << 10        # bodies up to this are parsed on the event loop (well under a millisecond)
LARGE_BODY_BYTES = 1 << 20           # bodies above this are parsed one at a time
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_large_parser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3core-json")   # large bodies queue here


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON; send finite numbers")


def parse_json(data: bytes) -> Any:
    """The JSON value of `data`, or APIError 400 (blocking: run it in a worker thread for large bodies)."""
    if data.count(b",") + 1 > MAX_JSON_VALUES:
        raise APIError(f"the request body holds more than {MAX_JSON_VALUES} JSON values; send fewer prompts or "
                       "split the request", code="request_too_large")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start}); send UTF-8 "
                       "JSON", code="invalid_json") from None
    try:
        value = json.loads(text, parse_constant=_constant)
    except RecursionError:
        raise APIError("the request body nests JSON too deeply; flatten it", code="invalid_json") from None
    except ValueError as exc:          # JSONDecodeError, NaN/Infinity, an integer of more than 4300 digits
        raise APIError(f"the request body is not valid JSON ({str(exc)[:200]})", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(data):                 # rare: only then walk the strings (in C, through dumps)
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError("the request body holds a lone UTF-16 surrogate escape (such as \\ud800) in a string; "
                           "send valid Unicode text", code="invalid_json") from None
    return value


async def parse_json_off_loop(data: bytes) -> Any:
    """parse_json: small bodies at once, others in a worker thread; large bodies wait for each other (one parse of
    a large body at a time)."""
    if len(data) <= INLINE_BODY_BYTES:                 # microseconds: a thread hop would cost more
        return parse_json(data)
    if len(data) <= LARGE_BODY_BYTES:
        return await asyncio.to_thread(parse_json, data)
    return await asyncio.get_running_loop().run_in_executor(_large_parser, parse_json, data)


async def read_body(request: Any, max_bytes: int, timeout_s: float | None) -> bytes | None:
    """The raw body within `timeout_s` and `max_bytes` (APIError 408 / 413); None if the client went away."""
    from starlette.requests import ClientDisconnect
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(f"the request body has {declared} bytes; this server accepts at most {max_bytes} "
                       "(--max-body-bytes)", status=413, code="request_too_large")
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > max_bytes:
                raise APIError(f"the request body is larger than {max_bytes} bytes (--max-body-bytes)",
                               status=413, code="request_too_large")
    try:
        async with asyncio.timeout(timeout_s):
            await read()
    except TimeoutError:
        raise APIError(f"the request body did not arrive within {timeout_s:g} s (--body-read-timeout); send it "
                       "at once", status=408, code="request_timeout") from None
    except ClientDisconnect:
        return None
    return bytes(body)
