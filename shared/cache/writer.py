"""Asynchronous write-back: a bounded queue drained in batches by one background thread.

`submit` never blocks the caller (the engine thread): when the queue is full the item is refused and the caller
counts a drop. `flush` waits (with a deadline) until everything submitted so far has been handled.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("pdserve.cache")
T = TypeVar("T")


class WriteBack(Generic[T]):
    def __init__(
        self, handle: Callable[[list[T]], None], max_queue: int, max_batch: int = 64, name: str = "cache-writer"
    ):
        if max_queue < 1 or max_batch < 1:
            raise ValueError(f"max_queue and max_batch must be >= 1, got {max_queue}, {max_batch}")
        self._handle, self.max_queue, self.max_batch = handle, max_queue, max_batch
        self._cv = threading.Condition()
        self._queue: deque[T] = deque()
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        with self._cv:
            return len(self._queue)

    def submit(self, item: T) -> bool:
        """Queue `item`; False (nothing queued) when the queue is full or the writer is closed."""
        with self._cv:
            if self._closing or len(self._queue) >= self.max_queue:
                return False
            self._queue.append(item)
            self._cv.notify()
            return True

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is empty and no batch is in flight; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Handle what is queued (up to `timeout`), then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch))]
                self._busy = True
            try:
                self._handle(batch)
            except Exception:
                log.exception("prompt cache write-back batch failed")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
