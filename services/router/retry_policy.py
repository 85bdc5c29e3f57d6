"""What the router does after an attempt (one prefill/decode pair) failed: a pure decision, no gRPC calls.

- The caller is gone: drop (end without a status).
- RESOURCE_EXHAUSTED before any token (the pair could not admit the request, e.g. decode's KV pool is full):
  retry from scratch on another pair; both instances are healthy, so neither is blamed.
- UNAVAILABLE (an instance went away): blame the pair (health-check it now; the failed one is avoided) and
  retry from scratch before the first token, or resume after it: the new pair gets prompt + the tokens already
  streamed and counts them as completion, so the caller sees one uninterrupted stream.
- Anything else, or no attempt / time left: fail the caller with the attempt's status and reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import grpc


class Action(Enum):
    RETRY = "retry"  # again from scratch on another pair
    RESUME = "resume"  # on another pair, continuing after the tokens the caller already has
    FAIL = "fail"  # end the caller's stream with `code`
    DROP = "drop"  # the caller went away: end quietly


@dataclass(frozen=True)
class Decision:
    action: Action
    blame: bool = False  # health-check the pair; exclude what fails (else exclude both)
    code: grpc.StatusCode | None = None  # FAIL: the status for the caller
    details: str = ""  # FAIL: its reason


def after_failure(
    code: grpc.StatusCode,
    details: str,
    *,
    attempt: int,
    max_attempts: int,
    streamed_tokens: int,
    caller_active: bool,
    time_left_s: float,
) -> Decision:
    """Decide after attempt number `attempt` (0-based) ended with `code`/`details`, the caller having received
    `streamed_tokens` tokens so far."""
    if not caller_active:
        return Decision(Action.DROP)
    pool_full = code == grpc.StatusCode.RESOURCE_EXHAUSTED and streamed_tokens == 0
    if (code != grpc.StatusCode.UNAVAILABLE and not pool_full) or attempt + 1 >= max_attempts or time_left_s <= 0:
        return Decision(Action.FAIL, code=code, details=details or "decode failed")
    if pool_full:
        return Decision(Action.RETRY, blame=False)
    return Decision(Action.RESUME if streamed_tokens else Action.RETRY, blame=True)
