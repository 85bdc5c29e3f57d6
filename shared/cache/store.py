"""Byte stores behind the prompt cache: one interface, Redis (`redis_store.RedisStore`) or in-process.

A store maps a key to one opaque value with a TTL; it knows nothing about KV pages. Every method may raise
StoreError (the store could not answer); the prompt cache turns that into misses or dropped writes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol


class StoreError(RuntimeError):
    """The store could not answer: down, too slow, or an error reply."""


class PageStore(Protocol):
    remote: bool  # True when reads cross the network (a local tier in front of it pays off)

    def get_many(self, keys: list[bytes], ttl_ms: int) -> list[bytes | None]:
        """Values in key order, None where absent; each hit's TTL is reset to `ttl_ms` (GETEX)."""

    def set_many(self, items: list[tuple[bytes, bytes]], ttl_ms: int) -> None:
        """Write values, each with TTL `ttl_ms`."""

    def touch_many(self, keys: list[bytes], ttl_ms: int) -> list[bool]:
        """Reset the TTL of keys that exist (pages hit in a tier in front of this store, or about to be written
        back); returns, in key order, which exist."""

    def close(self) -> None: ...


def copy_into(
    values: list[bytes | None], dest: Callable[[int, int], memoryview | None], max_value_bytes: int
) -> list[int | None]:
    """`get_many_into` for values already read: each copied into `dest(i, len)`; lengths, None where absent."""
    out: list[int | None] = []
    for i, v in enumerate(values):
        buf = dest(i, len(v)) if v is not None and len(v) <= max_value_bytes else None
        if buf is not None and v is not None:
            buf[:] = v
            out.append(len(v))
        else:
            out.append(None)
    return out


def get_many_into(
    store: PageStore, keys: list[bytes], ttl_ms: int, dest: Callable[[int, int], memoryview | None], max_bytes: int
) -> list[int | None]:
    """GETEX of `keys` with value i of n bytes written into `dest(i, n)`: straight from the socket where the store
    can (`RedisStore.get_many_into`), else copied from `get_many`. Lengths, None where absent or declined."""
    into = getattr(store, "get_many_into", None)
    if into is not None:
        return into(keys, ttl_ms, dest, max_bytes)
    return copy_into(store.get_many(keys, ttl_ms), dest, max_bytes)


class MemoryStore:
    """In-process store for a single instance (the embedded default, no Redis): LRU by total value bytes,
    TTL per key. Thread-safe."""

    remote = False

    def __init__(self, capacity_bytes: int, clock: Callable[[], float] = time.monotonic):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._items: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()  # key -> (value, expires_at)
        self.used_bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _pop(self, key: bytes) -> None:
        value, _ = self._items.pop(key)
        self.used_bytes -= len(value)

    def _live(self, key: bytes, now: float) -> bytes | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item[1] <= now:
            self._pop(key)
            return None
        return item[0]

    def get_many(self, keys: list[bytes], ttl_ms: int) -> list[bytes | None]:
        with self._lock:
            now = self._clock()
            out = []
            for k in keys:
                v = self._live(k, now)
                if v is not None:
                    self._items[k] = (v, now + ttl_ms / 1e3)
                    self._items.move_to_end(k)
                out.append(v)
            return out

    def set_many(self, items: list[tuple[bytes, bytes]], ttl_ms: int) -> None:
        with self._lock:
            now = self._clock()
            for k, v in items:
                if len(v) > self.capacity_bytes:
                    continue
                if k in self._items:
                    self._pop(k)
                while self.used_bytes + len(v) > self.capacity_bytes:
                    self._pop(next(iter(self._items)))  # least recently used
                    self.evictions += 1
                self._items[k] = (bytes(v), now + ttl_ms / 1e3)
                self.used_bytes += len(v)

    def touch_many(self, keys: list[bytes], ttl_ms: int) -> list[bool]:
        return [v is not None for v in self.get_many(keys, ttl_ms)]

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self.used_bytes = 0
