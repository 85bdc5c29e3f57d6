"""Prompt-cache write-backs behind the engine: whole requests' write-backs (`serving.write_back`) run on one
background thread, page by page, each page only while the instance has nothing else to do.

A request's pages are copied, encoded and put in the local tier by this thread, not by the request's RPC thread,
and never beside a prefill or a KV ship of this process: those share its GIL, and a 4k prompt of an 8B model is
276 MB to encode: written beside them, one request's write-back slows the next ones' prefill and spreads their
TTFT. Bounded: the jobs hold at most `max_bytes` of pages (the export buffers); a new job drops the
oldest waiting ones to fit (or itself, beside a running one too large), and a job that waits more than
`max_wait_s` for an idle moment drops the rest of its pages. Dropped pages are counted (`on_drop(pages)`). Under
sustained load most prompts are then not cached, which is the intent: the pool's own prefixes (`--prefix-reuse`)
still serve the repeats on this instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.cache.writer import WriteBack

log = logging.getLogger("pdserve.cache")

# A write-back: called on the writer thread with `wait_idle`, which it calls before each page (False: give up);
# returns how many pages it wrote.
Job = Callable[[Callable[[], bool]], int]


@dataclass
class _Queued:
    job: Job
    pages: int
    nbytes: int


class WriteBehind(WriteBack[_Queued]):
    """`submit` never blocks (the RPC thread); `flush` waits until every submitted job ran (tests, benchmarks). The
    queue and its thread are `WriteBack`'s, one job at a time, bounded by bytes instead of a count."""

    def __init__(
        self,
        busy: Callable[[], bool],
        max_bytes: int,
        max_wait_s: float = 2.0,
        on_drop: Callable[[int], None] = lambda pages: None,
        poll_s: float = 0.002,
        name: str = "cache-write-behind",
    ):
        if max_bytes < 1 or not max_wait_s > 0:
            raise ValueError(f"max_bytes must be >= 1 and max_wait_s > 0, got {max_bytes}, {max_wait_s}")
        self.busy, self.max_bytes, self.max_wait_s, self.on_drop, self.poll_s = (
            busy,
            max_bytes,
            max_wait_s,
            on_drop,
            poll_s,
        )
        self._bytes = 0  # of the queued jobs and the one running
        super().__init__(self._run_job, max_queue=1 << 30, max_batch=1, name=name)  # bounded by _bytes

    @property
    def _running(self) -> bool:
        return self._busy

    def submit(self, job: Job, pages: int, nbytes: int) -> bool:  # type: ignore[override]
        """Queue a request's write-back of `pages` pages held in `nbytes`. To make room, the oldest jobs still
        waiting are dropped (a recent prompt is the likelier to come again); False (dropped) when it does not fit
        beside the job running, or the writer is closed. Drops are counted."""
        dropped: list[int] = []
        with self._cv:
            while self._queue and self._bytes + nbytes > self.max_bytes:
                old = self._queue.popleft()
                self._bytes -= old.nbytes
                dropped.append(old.pages)
            accepted = not self._closing and self._bytes + nbytes <= self.max_bytes
            if accepted:
                self._queue.append(_Queued(job, pages, nbytes))
                self._bytes += nbytes
                self._cv.notify()
        for n in [*dropped, *([] if accepted else [pages])]:
            self.on_drop(n)
        return accepted

    def wait_idle(self) -> bool:
        """Until the instance is idle (True), or `max_wait_s` passed while it was not (False)."""
        deadline = time.monotonic() + self.max_wait_s
        while self.busy():
            if self._closing or time.monotonic() > deadline:
                return False
            time.sleep(self.poll_s)
        return True

    def _run_job(self, batch: list[_Queued]) -> None:
        """Writer thread: one job; the pages it did not write are counted as dropped, its bytes given back."""
        (item,) = batch
        written = 0
        try:
            written = item.job(self.wait_idle)
        except Exception:
            log.exception("prompt cache: write-back failed")
        finally:
            if written < item.pages:
                self.on_drop(item.pages - written)
            with self._cv:
                self._bytes -= item.nbytes
