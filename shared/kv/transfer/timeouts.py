"""The handoff's two bounds on a silent peer.

AckClock    prefill: how long decode has left a shipped page unacknowledged (`ack_timeout_s`)
Watchdog    decode: how long since the last message from prefill (`page_timeout_s`); cancels the stream
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class AckClock:
    """Ship times by seq_no and how far decode's cumulative acks reach. `shipped` runs on the RPC thread, `acked`
    on the ack reader thread; each is a single list append / int store, so no lock is needed."""

    def __init__(self) -> None:
        self._shipped_at: list[float] = []  # monotonic time each seq_no was handed to gRPC
        self._acked = 0  # seq_nos below this are acknowledged

    def shipped(self, num_pages: int = 1) -> None:
        now = time.monotonic()
        self._shipped_at.extend([now] * num_pages)

    def acked(self, seq_no: int) -> None:
        self._acked = max(self._acked, seq_no + 1)

    @property
    def num_acked(self) -> int:
        return self._acked

    @property
    def num_shipped(self) -> int:
        return len(self._shipped_at)

    def oldest_unacked_age(self, now: float | None = None) -> float:
        """Seconds since the oldest unacknowledged page was shipped; 0 when every shipped page is acknowledged."""
        acked, shipped = self._acked, self._shipped_at
        if acked >= len(shipped):
            return 0.0
        return (time.monotonic() if now is None else now) - shipped[acked]


class Watchdog:
    """Calls `on_expire` once (on its own thread) when `feed` has not been called for `timeout_s` seconds;
    `stop` ends it without calling. `expired` tells the caller why its blocked call was cancelled."""

    def __init__(self, timeout_s: float, on_expire: Callable[[], object], name: str = "watchdog"):
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
