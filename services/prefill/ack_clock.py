"""How long decode has left a shipped KV page unacknowledged (what `PrefillConfig.ack_timeout_s` bounds)."""

from __future__ import annotations

import time


class AckClock:
    """Ship times by seq_no and how far decode's cumulative acks reach. `shipped` runs on the RPC thread, `acked`
    on the ack reader thread; each is a single list append / int store, so no lock is needed."""

    def __init__(self) -> None:
        self._shipped_at: list[float] = []  # monotonic time each seq_no was handed to gRPC
        self._acked = 0  # seq_nos below this are acknowledged

    def shipped(self) -> None:
        self._shipped_at.append(time.monotonic())

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
