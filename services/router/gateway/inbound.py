"""What the gateway takes from an HTTP request: the JSON body (bounded in size, read time and nesting; strict JSON;
text valid UTF-8, no lone surrogates) and the headers it passes on to the router as gRPC metadata (only bytes
gRPC metadata can carry). Anything else is a 4xx naming what is wrong."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from pdserve.router.gateway.errors import APIError

MAX_JSON_DEPTH = 32  # nesting of an OpenAI body is at most ~6 (messages[i].content[j].text)
MAX_HEADER_CHARS = 4096  # a forwarded header's value; gRPC's metadata budget is 8 KiB for all of them
# passed on to the router as gRPC metadata (authorization: the caller's bearer token, which the router checks)
FORWARDED_HEADERS = ("traceparent", "tracestate", "x-priority", "authorization")
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context: an invalid one is dropped, as the spec says
_DIGITS = re.compile(r"[0-9]{1,30}")
_METADATA_VALUE = re.compile(r"[\x20-\x7e]*")  # what a gRPC (non-binary) metadata value may hold
CLOSE = {"Connection": "close"}  # for an answer to a client that stalled in its body


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `max_bytes` (declared length or bytes read),
    and with 408 (closing the connection) when it has not all arrived `timeout_s` after its headers. After a 413
    the rest of the body is read and dropped, so that the client, still sending, gets the answer; the connection
    deadline (`connection.py`) bounds that too."""
    too_large = APIError(413, f"request body larger than {max_bytes} bytes (--max-body-mb)", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if _DIGITS.fullmatch(declared) and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408,
            f"request body not received within {timeout_s:g} s (--body-timeout-s)",
            code="body_timeout",
            headers=CLOSE,
        ) from None
    except ClientDisconnect:  # nobody reads the answer; no traceback either
        raise APIError(400, "the client went away while sending the body", code="client_disconnected") from None
    return b"".join(chunks)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict:
    """A JSON object (strict: no NaN / Infinity), nested at most MAX_JSON_DEPTH deep, every string (keys too)
    encodable as UTF-8 (a lone surrogate escape such as \\ud800 is refused)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of too many digits
        raise APIError(400, f"request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    """Nesting depth and UTF-8 of every string, without recursion; the error names the top-level field."""
    stack: list[tuple[Any, int, str | None]] = [(body, 0, None)]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, str):
            _check_text(value, field)
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise APIError(
                    400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", param=field, code="invalid_json"
                )
            if isinstance(value, dict):
                for k, v in value.items():
                    name = k if field is None else field
                    _check_text(k, name)
                    stack.append((v, depth + 1, name))
            else:
                stack.extend((v, depth + 1, field) for v in value)


def _check_text(s: str, field: str | None) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            400,
            f"{f'{field!r}' if field else 'the body'} holds a lone UTF-16 surrogate (not valid Unicode text)",
            param=field,
            code="invalid_encoding",
        ) from None


def forwarded_metadata(request: Request) -> list[tuple[str, str]]:
    """The FORWARDED_HEADERS the request carries, as gRPC metadata. A value gRPC cannot carry (bytes outside
    printable ASCII, or over MAX_HEADER_CHARS): trace headers are dropped, `authorization` is a 401, others 400."""
    out = []
    for name in FORWARDED_HEADERS:
        value = request.headers.get(name)
        if value is None:
            continue
        if len(value) <= MAX_HEADER_CHARS and _METADATA_VALUE.fullmatch(value):
            out.append((name, value))
        elif name in TRACE_HEADERS:
            continue
        elif name == "authorization":
            raise APIError(
                401,
                "the Authorization header holds characters outside printable ASCII or is too long",
                code="invalid_authorization_header",
                type_="authentication_error",
            )
        else:
            raise APIError(
                400,
                f"the {name} header holds characters outside printable ASCII or is over {MAX_HEADER_CHARS} characters",
                code="invalid_header",
            )
    return out
