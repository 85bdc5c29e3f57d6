"""A per-request watchdog: decode's bound on the wait for the next message from prefill (`page_timeout_s`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    """Calls `on_expire` once (on its own thread) when `feed` has not been called for `timeout_s` seconds;
    `stop` ends it without calling. `expired` tells the caller why its blocked call was cancelled."""

    def __init__(self, timeout_s: float, on_expire: Callable[[], None], name: str = "watchdog"):
        self.timeout_s = timeout_s
        self.expired = False
        self._on_expire = on_expire
        self._last = time.monotonic()  # last feed; a float store, read by the watchdog thread
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def feed(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while not self._stopped:
                left = self._last + self.timeout_s - time.monotonic()
                if left <= 0:
                    self.expired = True
                    break
                self._cv.wait(left)
        if self.expired:
            self._on_expire()
