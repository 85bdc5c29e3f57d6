"""Event-driven waits for tests: poll a condition until it holds or a deadline passes (no fixed sleeps)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.01, what: str | None = None) -> T:
    """Call `condition` every `interval` seconds until it returns something truthy, and return that; raise
    TimeoutError (naming `what`, else the condition) when `timeout` seconds pass first. The deadline is a
    bound for a broken system, not a figure: a healthy one meets the condition long before it."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"not true after {timeout:.1f} s: {what or getattr(condition, '__name__', condition)}")
        time.sleep(interval)
