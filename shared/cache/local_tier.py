"""Bounded in-memory LRU of decoded pages on one instance, in front of the shared store.

Keys are chain digests (they already carry the namespace); values are PagePayloads of CPU tensors that are
never mutated after insertion. Bounded by payload bytes. Thread-safe.

A prefix is only usable from its first page on: a chain whose page 0 was evicted is dead weight however many of
its later pages remain. So a chain's pages are inserted and refreshed tail first (`put_chain`, `get_prefix`):
page 0 ends up the most recently used and eviction takes a chain from its tail.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

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

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._items

    def get_prefix(self, keys: Sequence[bytes]) -> list[PagePayload]:
        """The payloads of the longest run of `keys` from the first that are all held, refreshed tail first."""
        with self._lock:
            found: list[PagePayload] = []
            for k in keys:
                p = self._items.get(k)
                if p is None:
                    break
                found.append(p)
            for k in reversed(keys[: len(found)]):
                self._items.move_to_end(k)
            return found

    def put(self, key: bytes, payload: PagePayload) -> None:
        with self._lock:
            self._put(key, payload)

    def put_chain(self, items: Sequence[tuple[bytes, PagePayload]]) -> None:
        """Insert consecutive pages of one chain (in chain order) tail first, so that eviction reaches the tail
        before the head."""
        with self._lock:
            for key, payload in reversed(items):
                self._put(key, payload)

    def _put(self, key: bytes, payload: PagePayload) -> None:
        n = payload.nbytes
        if n > self.capacity_bytes:
            return
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
