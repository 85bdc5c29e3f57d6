"""Type and range checks of single OpenAI request fields: OpenAI's documented ranges, and within them what the
gRPC API can carry (int32 counts, uint64 seeds, int32 token ids). A value outside is a 400 naming the field."""

from __future__ import annotations

import math
from typing import Any

from pdserve.router.gateway.errors import APIError

INT32_MAX = 2**31 - 1  # max_tokens, token ids, max_reasoning_tokens: int32 fields of the gRPC API
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # OpenAI's `seed`
UINT64 = 2**64  # the gRPC API's seed: a negative OpenAI seed is taken modulo 2^64 (its two's complement)


def short(v: Any, limit: int = 60) -> str:
    """`repr(v)`, cut to `limit` characters: error messages never echo a whole body back."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    """`body[name]` as an int in [lo, hi] (a float with an integral value counts), None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v) or (isinstance(v, float) and not (math.isfinite(v) and v.is_integer())):
        raise APIError(400, f"'{name}' must be an integer, got {short(v)}", param=name, code="invalid_type")
    if not lo <= v <= hi:  # exact for ints of any size against float bounds too
        raise APIError(400, f"'{name}' must be in [{lo}, {hi}], got {short(v)}", param=name, code="invalid_value")
    return int(v)


def number(body: dict, name: str, lo: float, hi: float) -> float | None:
    """`body[name]` as a finite float in [lo, hi], None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v):
        raise APIError(400, f"'{name}' must be a number, got {short(v)}", param=name, code="invalid_type")
    if not lo <= v <= hi:  # also refuses NaN and infinities
        raise APIError(400, f"'{name}' must be in [{lo:g}, {hi:g}], got {short(v)}", param=name, code="invalid_value")
    return float(v)


def boolean(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise APIError(400, f"'{name}' must be a boolean, got {short(v)}", param=name, code="invalid_type")
    return v


def seed(body: dict) -> int | None:
    """OpenAI's int64 `seed` as the gRPC API's uint64 (negative seeds wrap: -1 is 2^64 - 1)."""
    v = integer(body, "seed", INT64_MIN, INT64_MAX)
    return None if v is None else v % UINT64


def neutral_only(body: dict, name: str, neutral: int, lo: float, hi: float) -> None:
    """A parameter pdserve accepts only at its no-op value `neutral` (within OpenAI's range [lo, hi])."""
    v = number(body, name, lo, hi)
    if v is not None and v != neutral:
        raise APIError(400, f"'{name}' is not supported (only {neutral})", param=name, code="unsupported_value")


def token_ids(prompt: list, param: str = "prompt") -> list[int]:
    """A token-id prompt: every id an int in [0, 2^31) (the router checks them against the vocabulary)."""
    for t in prompt:
        if not 0 <= t <= INT32_MAX:
            message = f"'{param}' token ids must be in [0, {INT32_MAX}], got {short(t)}"
            raise APIError(400, message, param=param, code="invalid_value")
    return prompt


def token_bias(body: dict, name: str = "logit_bias", limit: int = 300) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: {"<token id>": bias in [-100, 100]}, at most `limit` entries (ids as strings, or
    ints), as {id: bias}; None when absent."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise APIError(400, f"'{name}' must be an object of token id -> bias", param=name, code="invalid_type")
    if len(v) > limit:
        raise APIError(400, f"'{name}' has {len(v)} entries: at most {limit}", param=name, code="invalid_value")
    out: dict[int, float] = {}
    for key, bias in v.items():
        try:
            t = int(key)
        except ValueError:
            t = -1
        if not 0 <= t <= INT32_MAX:
            message = f"'{name}' keys must be token ids in [0, {INT32_MAX}], got {short(key)}"
            raise APIError(400, message, param=name, code="invalid_value")
        if not _is_number(bias) or not -100 <= bias <= 100:
            message = f"'{name}' values must be numbers in [-100, 100], got {short(bias)}"
            raise APIError(400, message, param=name, code="invalid_value")
        out[t] = float(bias)
    return out


def token_id_list(body: dict, name: str, limit: int) -> list[int] | None:
    """A list of at most `limit` token ids in [0, 2^31), None when absent."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(_is_number(t) and isinstance(t, int) for t in v):
        raise APIError(400, f"'{name}' must be a list of token ids", param=name, code="invalid_type")
    if len(v) > limit:
        raise APIError(400, f"'{name}' takes at most {limit} token ids", param=name, code="invalid_value")
    return token_ids(v, name)
