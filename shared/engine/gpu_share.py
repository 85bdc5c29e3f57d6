"""A decode engine that shares its GPU with a prefill engine (another process: `pdserve up` on one GPU) holds its
steps back while the prefill computes, as far as its TPOT allows.

Both processes launch work on the one GPU whenever they have some (MPS runs it side by side), so a prefill chunk
beside a decode batch that steps back to back takes longer than alone, and every first token with it
(docs/benchmarks.md, "One GPU"). Decode has room: at small batches its steps take well under its TPOT bound. So:

- the prefill engine marks each of its steps in a small shared file (`GpuShareFlag`: an 8-byte deadline, epoch ns,
  past which the mark lapses by itself: a prefill that dies mid-step holds nothing back);
- the decode engine earns yield credit each step, `target_step_ms` minus the step's own time (`YieldCredit`,
  capped), and before a step, while the prefill's mark is up, waits in short slices spending that credit
  (`DecodeYield.before_step`). A decode at its TPOT target earns none and never waits.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

FLAG_BYTES = 8
MARK_LEASE_NS = 500_000_000  # a mark lapses this long after it was set unless renewed or cleared
SLICE_S = 0.0005  # the longest single wait before the mark is read again


class GpuShareFlag:
    """An 8-byte file mapped by both engines: 0, or the epoch-ns deadline of the prefill step in progress."""

    def __init__(self, path: str | Path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < FLAG_BYTES:
                os.ftruncate(fd, FLAG_BYTES)
            self._map = mmap.mmap(fd, FLAG_BYTES)
        finally:
            os.close(fd)

    def mark(self, lease_ns: int = MARK_LEASE_NS) -> None:
        """Prefill: a step starts (its mark holds until `clear` or for `lease_ns`)."""
        struct.pack_into("<q", self._map, 0, time.time_ns() + lease_ns)

    def clear(self) -> None:
        struct.pack_into("<q", self._map, 0, 0)

    def marked(self) -> bool:
        """Decode: whether a prefill step is in progress now."""
        return struct.unpack_from("<q", self._map, 0)[0] > time.time_ns()

    def close(self) -> None:
        self._map.close()


class YieldCredit:
    """Milliseconds decode may wait: each step earns `target_step_ms` minus its own ms (none when slower), up to
    `cap_ms`; waits spend it."""

    def __init__(self, target_step_ms: float, cap_ms: float):
        self.target_step_ms, self.cap_ms = target_step_ms, cap_ms
        self.ms = 0.0

    def earn(self, step_ms: float) -> None:
        self.ms = min(self.cap_ms, self.ms + max(0.0, self.target_step_ms - step_ms))

    def spend(self, ms: float) -> None:
        self.ms = max(0.0, self.ms - ms)


class DecodeYield:
    """The decode engine's side: `before_step(interrupted)` waits while the prefill's mark is up and credit is
    left (returns the ms waited; `interrupted()` true ends the wait early: the loop has a command to run);
    `after_step(ms)` earns credit. Totals in `waited_ms` / `waits`."""

    def __init__(self, flag: GpuShareFlag, credit: YieldCredit, sleep: Callable[[float], None] = time.sleep):
        self.flag, self.credit, self._sleep = flag, credit, sleep
        self.waited_ms = 0.0
        self.waits = 0

    def before_step(self, interrupted: Callable[[], bool] = lambda: False) -> float:
        waited = 0.0
        t0 = time.perf_counter()
        while self.credit.ms - waited > 0 and self.flag.marked() and not interrupted():
            self._sleep(min(SLICE_S, (self.credit.ms - waited) / 1e3))
            waited = (time.perf_counter() - t0) * 1e3
        if waited:
            self.credit.spend(waited)
            self.waited_ms += waited
            self.waits += 1
        return waited

    def after_step(self, step_ms: float) -> None:
        self.credit.earn(step_ms)
