"""Bounded in-memory LRU of decoded pages on one instance, in front of the shared store.

Keys are chain digests (they already carry the namespace); values are PagePayloads of CPU tensors that are
never mutated after insertion. Bounded by payload bytes. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pdserve.kv.payload import PagePayload


class LocalTier:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()
        self._items: OrderedDict[bytes, PagePayload] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def get(self, key: bytes) -> PagePayload | None:
        with self._lock:
            p = self._items.get(key)
            if p is not None:
                self._items.move_to_end(key)
            return p

    def put(self, key: bytes, payload: PagePayload) -> None:
        n = payload.nbytes
        if n > self.capacity_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.used_bytes -= old.nbytes
            while self.used_bytes + n > self.capacity_bytes:
                _, evicted = self._items.popitem(last=False)
                self.used_bytes -= evicted.nbytes
            self._items[key] = payload
            self.used_bytes += n

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.used_bytes = 0
