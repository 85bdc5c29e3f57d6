"""Measured rates of recent work: units (tokens, bytes) per second of busy time, decayed so the figure follows
the last `tau_s` busy seconds whatever the idle time between (a prefill instance's tokens/s, a cache store's
fetch bytes/s). Thread-safe."""

from __future__ import annotations

import math
import threading


class WorkRate:
    """units / busy seconds over recent samples; `rate()` is None until `min_seconds` of work were measured."""

    def __init__(self, tau_s: float = 20.0, min_seconds: float = 0.01):
        self.tau_s, self.min_seconds = tau_s, min_seconds
        self._units = self._seconds = 0.0
        self._lock = threading.Lock()
        self._step: tuple[object, float, float, float] | None = None  # open step: (key, units, start, end)

    def add(self, units: float, seconds: float) -> None:
        """One piece of work: `units` done in `seconds` of busy time (older work decays by its duration)."""
        if seconds <= 0 or units < 0:
            return
        with self._lock:
            self._add(units, seconds)

    def _add(self, units: float, seconds: float) -> None:
        keep = math.exp(-seconds / self.tau_s)
        self._units = self._units * keep + units
        self._seconds = self._seconds * keep + seconds

    def add_to_step(self, key: object, units: float, start: float, end: float) -> None:
        """Work of one step reported in parts (one per request of a batch): parts with the same `key` add their
        units to one sample spanning start..latest end; a new key closes the previous step into the rate."""
        with self._lock:
            if self._step is not None and self._step[0] == key:
                _, u, s, e = self._step
                self._step = (key, u + units, s, max(e, end))
                return
            self._close()
            self._step = (key, units, start, end)

    def _close(self) -> None:
        if self._step is not None:
            _, u, s, e = self._step
            self._step = None
            if e > s:
                self._add(u, e - s)

    def rate(self) -> float | None:
        with self._lock:
            self._close()
            return self._units / self._seconds if self._seconds >= self.min_seconds else None
