"""The SDK's retry of RESOURCE_EXHAUSTED: the router rejects a request it cannot serve within its budgets and
says when to come back (`grpc-retry-pushback-ms`, gRPC's own trailer, or `retry-after-ms`); the client sleeps
that long and tries again, within a bounded number of attempts, a bounded total wait and the call's deadline.
Streams are retried only before their first chunk (a retry must never repeat tokens the caller has seen)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import grpc

PUSHBACK_KEYS = ("grpc-retry-pushback-ms", "retry-after-ms")  # gRPC's key first


def pushback_s(err: grpc.RpcError) -> float | None:
    """The server's retry delay in seconds from the error's trailing metadata: None when it sent none, -1.0 when
    it asked not to be retried (a negative or malformed value, as gRPC's retry design reads
    `grpc-retry-pushback-ms`)."""
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    values = dict(trailers or ())
    for key in PUSHBACK_KEYS:
        if key in values:
            try:
                ms = int(values[key])
            except (TypeError, ValueError):
                return -1.0
            return ms / 1e3 if ms >= 0 else -1.0
    return None


@dataclass
class RetryPolicy:
    """Retries of RESOURCE_EXHAUSTED. `max_attempts` counts the first try; `max_wait_s` bounds the sleeps of one
    call together (the bound that matters: a burst of rejected clients must outlast the burst). A RESOURCE_EXHAUSTED
    without a pushback is not retried: pdserve's own rejections (admission, thread budget) always carry one, gRPC's
    (a message over the server's size limit) cannot succeed on a retry. A pushback is a lower bound: the n-th retry
    waits at least `min_delay_s * backoff ** (n - 1)` (capped at `max_delay_s`), so a router whose estimate says
    "soon" many times in a row is not hammered until the attempts run out. Each delay gets up to `jitter` of itself
    added at random, so that clients rejected together do not return together."""

    max_attempts: int = 64
    max_wait_s: float = 20.0
    min_delay_s: float = 0.05
    backoff: float = 1.5
    max_delay_s: float = 2.0
    jitter: float = 0.2
    rng: random.Random = field(default_factory=random.Random, repr=False)

    def delay(self, err: grpc.RpcError, attempt: int, waited_s: float, deadline: float | None) -> float | None:
        """Seconds to sleep before attempt `attempt + 1` after `err` ended attempt `attempt` (1-based), having
        slept `waited_s` already; None: give up and raise `err`. `deadline`: time.monotonic() the call must end by."""
        if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt >= self.max_attempts:
            return None
        push = pushback_s(err)
        if push is None or push < 0:
            return None  # gRPC's own refusal (message too large), or the server asked not to be retried
        floor = min(self.max_delay_s, self.min_delay_s * self.backoff ** (attempt - 1))
        base = max(floor, push)
        d = base * (1.0 + self.jitter * self.rng.random())
        if waited_s + d > self.max_wait_s:
            return None
        if deadline is not None and time.monotonic() + d >= deadline:
            return None
        return d
