"""The router's served models as the gateway last heard them, per caller credential: each completion request needs
the list (which model it runs on, `models.forward_name`), and asking the router every time costs a round trip per
request. Entries live `ttl_s` seconds; at most `max_entries` credentials are kept (the least recently used one goes
first); concurrent requests of one credential share one ListModels call. Only answers are kept: an error (a bad
token, an unreachable router) is raised to every caller waiting on that call and asked again next time.

Keyed by the credential, never shared across credentials: the router authenticates ListModels, so one tenant's
answer (or rejection) is never given to another. The key is a digest of the `authorization` value, so the cache
holds no token."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

Names = list[str] | None  # the served model names; None: a router without ListModels (models.router_models)
Fetch = Callable[[Sequence[tuple[str, str]]], Awaitable[Names]]


def credential_key(metadata: Sequence[tuple[str, str]]) -> bytes:
    """Which credential `metadata` carries: a digest of its `authorization` value (b"" digest for none)."""
    auth = next((v for k, v in metadata if k == "authorization"), "")
    return hashlib.sha256(auth.encode()).digest()


class ModelListCache:
    """`await cache.get(metadata)`: the router's model names for the caller of `metadata` (see the module doc)."""

    def __init__(
        self, fetch: Fetch, ttl_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s < 0 or max_entries < 1:
            raise ValueError(f"ttl_s must be >= 0 and max_entries >= 1, got {ttl_s}, {max_entries}")
        self._fetch = fetch
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[bytes, tuple[float, Names]] = OrderedDict()  # key -> (expiry, names), LRU order
        self._inflight: dict[bytes, asyncio.Future[Names]] = {}  # key -> its call now running

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, metadata: Sequence[tuple[str, str]]) -> Names:
        """The names for this caller: the kept answer while it is fresh, else one call shared by its concurrent
        callers (with ttl_s 0 every request asks). Errors of the call raise."""
        if self._ttl_s == 0:
            return await self._fetch(metadata)
        key = credential_key(metadata)
        hit = self._entries.get(key)
        if hit is not None and hit[0] > self._clock():
            self._entries.move_to_end(key)
            return list(hit[1]) if hit[1] is not None else None
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._fetch_and_keep(key, metadata))
            self._inflight[key] = task
            task.add_done_callback(functools.partial(self._call_done, key))
        names = await asyncio.shield(task)  # a caller that goes away does not cancel the others' call
        return list(names) if names is not None else None

    async def _fetch_and_keep(self, key: bytes, metadata: Sequence[tuple[str, str]]) -> Names:
        names = await self._fetch(metadata)
        self._entries[key] = (self._clock() + self._ttl_s, names)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return names

    def _call_done(self, key: bytes, task: asyncio.Future[Names]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: an error no caller awaited any more is not logged as "never retrieved"
