"""Circuit breaker for the remote store: after `failures` consecutive errors the store is skipped for
`cooldown_s` (lookups become misses, writes are dropped); then one probe is let through: success closes the
breaker, failure opens it for another cooldown. Thread-safe."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, failures: int = 3, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if failures < 1 or cooldown_s < 0:
            raise ValueError(f"bad breaker settings: failures={failures}, cooldown_s={cooldown_s}")
        self.failures, self.cooldown_s, self._clock = failures, cooldown_s, clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self.times_opened = 0

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May a call go to the store now? In half-open state only one probe at a time is allowed."""
        with self._lock:
            if self._state == CLOSED:
                return True
            if self._state == OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self._state = HALF_OPEN
            if self._state == HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._state, self._consecutive, self._probing = CLOSED, 0, False

    def failure(self) -> None:
        with self._lock:
            self._consecutive += 1
            self._probing = False
            if self._state == HALF_OPEN or (self._state == CLOSED and self._consecutive >= self.failures):
                self._state, self._opened_at = OPEN, self._clock()
                self.times_opened += 1
