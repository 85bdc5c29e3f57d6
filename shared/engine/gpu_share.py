"""A decode engine that shares its GPU with a prefill engine (another process: `pdserve up` on one GPU) holds its
steps back while the prefill computes, as far as its TPOT allows.

Both processes launch work on the one GPU whenever they have some (MPS runs it side by side), so a prefill chunk
beside a decode batch that steps back to back takes longer than alone, and every first token with it
(docs/benchmarks.md, "One GPU"). Decode has room: at small batches its steps take well under its TPOT bound. So:

- the prefill engine marks each of its steps in a small shared file (`GpuShareFlag`: an 8-byte deadline, epoch ns,
  past which the mark lapses by itself: a prefill that dies mid-step holds nothing back);
- the decode engine, before a step, while the prefill's mark is up, waits in short slices
  (`DecodeYield.before_step`) as long as every running request keeps its TPOT within `tpot_ms` (`TpotRoom`): a
  request that streamed c tokens, its first e ms ago, may wait w before its next token while (e + w + step) / c <=
  tpot_ms, even if that token is its last. A request near its bound leaves no room, so the decode does not wait; a
  request well under it (most of them, at low load) lends the prefill its slack. The waits before one step last
  at most `cap_ms` in all (what a hold may add to one inter-token latency).

A credit earned per step (a fixed step target minus each step's time, the form measured first) kept the steps'
average but not each request's TPOT: it was spent where a request had no room (docs/benchmarks.md, "One GPU").
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
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


class TpotRoom:
    """Each running request's TPOT room: the ms its next token may still be held back while its TPOT stays within
    `tpot_ms` should that token be its last. Fed with every output the decode streams (`streamed`) and each
    request's end (`ended`); any thread."""

    def __init__(self, tpot_ms: float):
        self.tpot_ms = tpot_ms
        self._lock = threading.Lock()
        self._choices: dict[tuple[str, int], tuple[int, int]] = {}  # (request id, choice) -> (first token ns, count)

    def streamed(self, request_id: str, index: int, new_tokens: int, finished: bool, now_ns: int) -> None:
        """A choice streamed `new_tokens` tokens at `now_ns` (its first output: when its TPOT starts counting)."""
        key = (request_id, index)
        with self._lock:
            if finished:
                self._choices.pop(key, None)
            elif new_tokens > 0:
                first, count = self._choices.get(key, (now_ns, 0))
                self._choices[key] = (first, count + new_tokens)

    def ended(self, request_id: str) -> None:
        """The request is gone (finished, failed, released): none of its choices holds room any more."""
        with self._lock:
            for key in [k for k in self._choices if k[0] == request_id]:
                del self._choices[key]

    def room_ms(self, next_step_ms: float, now_ns: int) -> float:
        """The longest wait before the next step (of `next_step_ms`) that keeps every choice within `tpot_ms`
        (inf: none streams yet)."""
        with self._lock:
            rooms = [self.tpot_ms * count - (now_ns - first) / 1e6 for first, count in self._choices.values()]
        return min(rooms, default=float("inf")) - next_step_ms

    def __len__(self) -> int:
        with self._lock:
            return len(self._choices)


class DecodeYield:
    """The decode engine's side: `before_step(interrupted)` waits while the prefill's mark is up and every running
    request has TPOT room left, and at most `cap_ms` before one step in all (however many waits a command cut
    short: the most a hold adds to one inter-token latency) (returns the ms waited; `interrupted()` true ends the
    wait early: the loop has a command to run); `after_step(ms)` records the step's time (the next one's estimate).
    Totals in `waited_ms` / `waits`."""

    def __init__(self, flag: GpuShareFlag, room: TpotRoom, cap_ms: float, sleep: Callable[[float], None] = time.sleep):
        self.flag, self.room, self.cap_ms, self._sleep = flag, room, cap_ms, sleep
        self.last_step_ms = 0.0
        self.held_ms = 0.0  # waited since the last step
        self.waited_ms = 0.0
        self.waits = 0

    def before_step(self, interrupted: Callable[[], bool] = lambda: False) -> float:
        if not self.flag.marked():
            return 0.0
        allowed = min(self.cap_ms - self.held_ms, self.room.room_ms(self.last_step_ms, time.time_ns()))
        waited = 0.0
        t0 = time.perf_counter()
        while allowed - waited > 0 and self.flag.marked() and not interrupted():
            self._sleep(min(SLICE_S, (allowed - waited) / 1e3))
            waited = (time.perf_counter() - t0) * 1e3
        if waited:
            self.held_ms += waited
            self.waited_ms += waited
            self.waits += 1
        return waited

    def after_step(self, step_ms: float) -> None:
        self.last_step_ms = step_ms
        self.held_ms = 0.0
