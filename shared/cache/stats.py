"""Prompt-cache counters (thread-safe). Units are pages unless the name says otherwise."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

MAX_SCOPES = 256  # distinct scopes counted by name (tenants of one router config); the rest share OTHER_SCOPE
OTHER_SCOPE = "(other)"


@dataclass
class CacheStats:
    lookups: int = 0  # lookup() calls
    lookup_pages: int = 0  # full pages asked for (the cacheable part of each prompt)
    hits: int = 0  # pages found (local tier + store), longest prefix only
    local_hits: int = 0  # of `hits`, served by the in-memory local tier
    mac_failures: int = 0  # values whose MAC did not verify: forged, damaged, or keyed otherwise (misses)
    corrupt: int = 0  # values that verified but failed parsing / checksum / value checks (misses)
    errors: int = 0  # store errors (timeouts, connection refused, server errors)
    skipped: int = 0  # lookups / writes skipped because the circuit breaker was open
    store_slower: int = 0  # lookups that skipped the store: fetching measured slower than computing
    writes: int = 0  # pages written to the store
    rekeyed: int = 0  # pages found under a previous cache secret, written again under the current one
    write_bytes: int = 0
    write_drops: int = 0  # pages not written: write-back queue full or breaker open
    write_skips: int = 0  # pages not written back: the store held them already (asked before the write)
    too_large: int = 0  # pages not written: value above the size cap
    # per prompt-cache scope (the router's tenant or shared namespace; "" unscoped): [pages asked for, pages found]
    _scopes: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self, k, getattr(self, k) + v)

    def add_scope(self, scope: str, lookup_pages: int, hits: int) -> None:
        """One lookup's pages for `scope`. Scopes past MAX_SCOPES are counted under OTHER_SCOPE (bounded labels)."""
        with self._lock:
            if scope not in self._scopes and len(self._scopes) >= MAX_SCOPES:
                scope = OTHER_SCOPE
            row = self._scopes.setdefault(scope, [0, 0])
            row[0] += lookup_pages
            row[1] += hits

    def scopes(self) -> dict[str, tuple[int, int]]:
        """scope -> (pages asked for, pages found), read consistently."""
        with self._lock:
            return {k: (v[0], v[1]) for k, v in self._scopes.items()}

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
