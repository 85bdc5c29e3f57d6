"""Prompt-cache counters (thread-safe). Units are pages unless the name says otherwise."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class CacheStats:
    lookups: int = 0  # lookup() calls
    lookup_pages: int = 0  # full pages asked for (the cacheable part of each prompt)
    hits: int = 0  # pages found (local tier + store), longest prefix only
    local_hits: int = 0  # of `hits`, served by the in-memory local tier
    corrupt: int = 0  # values that failed parsing / checksum (treated as misses)
    errors: int = 0  # store errors (timeouts, connection refused, server errors)
    skipped: int = 0  # lookups / writes skipped because the circuit breaker was open
    store_slower: int = 0  # lookups that skipped the store: fetching measured slower than computing
    writes: int = 0  # pages written to the store
    write_bytes: int = 0
    write_drops: int = 0  # pages not written: write-back queue full or breaker open
    too_large: int = 0  # pages not written: value above the size cap
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    @property
    def misses(self) -> int:
        return self.lookup_pages - self.hits

    def hit_ratio(self) -> float:
        """Pages found / pages asked for (0 before any lookup)."""
        return _ratio(self.hits, self.lookup_pages)

    def local_hit_ratio(self) -> float:
        """Share of the pages asked for that the local tier served (what it adds in front of the store)."""
        return _ratio(self.local_hits, self.lookup_pages)

    def snapshot(self) -> dict[str, float]:
        """Every counter plus misses, hit_ratio and local_hit_ratio, read consistently."""
        with self._lock:
            d: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        d["misses"] = d["lookup_pages"] - d["hits"]
        d["hit_ratio"] = _ratio(d["hits"], d["lookup_pages"])
        d["local_hit_ratio"] = _ratio(d["local_hits"], d["lookup_pages"])
        return d


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0
