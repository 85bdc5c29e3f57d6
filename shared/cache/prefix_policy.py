"""Where a prompt's prefix comes from on an engine that computes prompts (prefill, colocated), and what goes back to
the prompt cache: the one place that decides lookup, reuse and write-back.

    plan = policy.plan(ns, prompt, compute_all, tokens_per_s, pool_held)   before the request is queued
    EngineRequest(..., cached_pages=plan.cached_pages, prefix_keys=plan.prefix_keys)
    policy.write_back(ns, plan, first_page, batches, layout)               after its pages went out

Order of preference for the prompt's full pages (the last prompt token is always computed: it samples the first
token): the engine pool's own prefix pages (`--prefix-reuse`: no compute, no copy) when they reach at least as far
as the prompt cache's copy; else the prompt cache's tiers (`PromptCache.lookup`: local tier, then the store when
fetching beats computing); else compute. Prompt logprobs (every prompt token is scored) and a colocated resume
(it recomputes) take nothing from either.

With `fetch_device` (an engine that races fetches: prefill), the store's pages are not waited for: the plan holds
the local tier's pages and a started `PrefixFetch` of the store's pages after them (`plan.fetch`,
`EngineRequest.prefix_fetch`); the engine loads the pages that land before its compute reaches them
(`pdserve.engine.prefix_fetch`), and the write-back skips the pages the fetch found in the store and asks the store
about those it never read (a page the compute covered first is not known to be there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prefix_fetch import PrefixFetch
from pdserve.cache.prompt_cache import CacheLookup, PromptCache
from pdserve.cache.serving import pages_to_write, write_back
from pdserve.cache.write_behind import WriteBehind
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload
from pdserve.kv.transfer import ExportedPages


@dataclass
class PrefixPlan:
    """One request's prefix decision."""

    max_reuse: int  # full pages it may reuse at most: (prompt tokens - 1) // page_size
    keys: list[bytes] = field(default_factory=list)  # its full pages' keys when the pool may reuse them, else []
    hit: CacheLookup = field(default_factory=lambda: CacheLookup([], []))  # the cache's pages (none: pool serves)
    pool_pages: int = 0  # the pool's prefix, when it beats the cache's copy (admission may find fewer)
    fetch: PrefixFetch | None = None  # the store's pages after `hit`, racing the compute (fetch_device engines)

    @property
    def cached_pages(self) -> list[PagePayload] | None:
        """`EngineRequest.cached_pages`: the prefix from the prompt cache (None: nothing to import)."""
        return self.hit.pages or None

    @property
    def prefix_keys(self) -> list[bytes] | None:
        """`EngineRequest.prefix_keys`: start on the pool's pages of this prefix and register the computed ones."""
        return self.keys or None

    @property
    def write_keys(self) -> list[bytes]:
        """Keys of the prompt's full pages for the write-back ([]: nothing to write)."""
        return self.hit.keys or self.keys  # hit.keys: none when the pool made the lookup moot

    def write_pages(self, prefix_pages: int) -> tuple[list[int], list[int]]:
        """The request's full pages for the write-back: (pages to write, pages to write only where the store lacks
        them). Neither: the `prefix_pages` the pool or the cache's tiers gave, and the pages the fetch read and
        verified in the store. Asked first: the fetch's pages it never read (those the compute covered before its
        start, those after it was cancelled or ended) except the one a miss or a failed check ended it at."""
        n, first = len(self.write_keys), max(prefix_pages, self.hit.num_pages)
        f = self.fetch
        if f is None:
            return list(range(first, n)), []
        verified, stop = f.verified_pages()
        write = [i for i in range(first, n) if i not in verified and not (f.first_page <= i < f.end_page)]
        ask = [i for i in range(max(first, f.first_page), min(n, f.end_page)) if i not in verified]
        if stop is not None and stop in ask:
            ask.remove(stop)
            write = sorted([*write, stop])
        return write, ask

    def fetched_pages(self) -> list[int]:
        """Pages the fetch read and verified (a local tier takes them at the write-back, from the shipped rows)."""
        return sorted(self.fetch.verified_pages()[0]) if self.fetch is not None else []

    def new_pages(self) -> list[int]:
        """Indexes of the full prompt pages the cache's tiers did not supply (what a write-back may store)."""
        write, ask = self.write_pages(0)
        return sorted(write + ask)

    def close(self) -> None:
        """The request is done with its prefix: a fetch still running stops, its buffers are let go."""
        if self.fetch is not None:
            self.fetch.close()

    def fetch_attributes(self) -> dict[str, Any]:
        """Span attributes of the racing fetch at the request's end (`PrefixFetch.span_attributes`; {}: none)."""
        return self.fetch.span_attributes() if self.fetch is not None else {}

    def attributes(self, cache_enabled: bool) -> dict[str, Any]:
        """Span attributes of the lookup (`prefill.cache_lookup`)."""
        hit = self.hit
        return {
            "pdserve.cache.enabled": cache_enabled,
            "pdserve.cache.pages_hit": hit.num_pages,  # from the prompt cache's tiers
            "pdserve.cache.pool_pages": self.pool_pages,  # the pool's own prefix (admission may find fewer)
            "pdserve.cache.pages_miss": max(0, self.max_reuse - hit.num_pages - self.pool_pages),
            "pdserve.cache.local_hits": hit.local_hits,
            "pdserve.cache.fetch_pages": self.fetch.num_pages if self.fetch is not None else 0,
            **(hit.decision.attributes() if hit.decision is not None else {}),
        }


class PrefixPolicy:
    """`cache`: the prompt cache (None: off); `pool_reuse`: the engine keeps computed prompt pages as prefixes
    (`--prefix-reuse`); `write_behind`: write-backs queued behind the engine's work (None: written at once);
    `fetch_device`: the device of an engine that races the store's pages (`EngineRequest.prefix_fetch`; None: the
    lookup waits for them); `chunk_tokens`: that engine's prefill chunk (0: unknown)."""

    def __init__(
        self,
        cache: PromptCache | None,
        page_size: int,
        pool_reuse: bool,
        write_behind: WriteBehind | None = None,
        fetch_device: torch.device | str | None = None,
        chunk_tokens: int = 0,
    ) -> None:
        self.cache = cache
        self.chunk_pages = chunk_tokens // page_size  # the engine's prefill chunk (where a racing fetch starts)
        self.fetch_device = fetch_device
        self.page_size = page_size
        self.pool_reuse = pool_reuse
        self.write_behind = write_behind

    def plan(
        self,
        ns: CacheNamespace,
        prompt: list[int],
        compute_all: bool,
        tokens_per_s: float | None,
        pool_held: Callable[[list[bytes]], int] | None = None,
    ) -> PrefixPlan:
        """Decide before the request is queued. `compute_all`: every prompt token must be computed (prompt
        logprobs; a colocated resume); `tokens_per_s`: the instance's measured prefill rate (whether fetching from
        the store beats computing); `pool_held(keys)`: how many leading pages of `keys` the engine pool holds."""
        plan = PrefixPlan((len(prompt) - 1) // self.page_size)
        if compute_all:
            return plan
        plan.keys = ns.page_keys(prompt) if self.pool_reuse else []
        in_pool = pool_held(plan.keys[: plan.max_reuse]) if plan.keys and pool_held is not None else 0
        cache = self.cache
        if not (in_pool and in_pool == plan.max_reuse) and cache is not None:  # the pool may serve it all
            if self.fetch_device is not None:
                plan.hit, plan.fetch = cache.lookup_racing(
                    ns, prompt, plan.max_reuse, tokens_per_s, plan.keys or None, self.fetch_device, self.chunk_pages
                )
            else:
                plan.hit = cache.lookup(ns, prompt, plan.max_reuse, tokens_per_s, plan.keys or None)
        if in_pool and in_pool >= plan.hit.num_pages:  # the pool's pages beat a copy of the same prefix
            plan.pool_pages = in_pool
            plan.hit = CacheLookup(plan.hit.keys, [], 0, plan.hit.decision)
        return plan

    def write_back(
        self,
        ns: CacheNamespace,
        plan: PrefixPlan,
        first_page: int,
        batches: list[ExportedPages],
        layout: KVLayoutSpec,
    ) -> None:
        """Put the request's full pages from `first_page` on (those before came from the pool or the cache), but
        those its fetch found in the store (`PrefixPlan.write_pages`; the pages it never read are asked), into the
        cache; with a local tier, the pages the fetch verified go to it alone. Behind the engine (`write_behind`):
        queued, the batches' device rows held until it ran (counted against its bytes) while their pinned host copies
        are let go now, so the next send reuses that pinned memory instead of pinning more. Without: written now."""
        plan.close()  # the fetch ends: what it verified is final
        cache, keys = self.cache, plan.write_keys
        if cache is None or not keys:
            return
        write, ask = plan.write_pages(first_page)
        local = [i for i in plan.fetched_pages() if i >= first_page] if cache.local is not None else []
        if self.write_behind is None:
            write_back(cache, ns, keys, write, ask, batches, layout, local=local)
            return
        for b in batches:
            if b.rows.device.type == "cuda":
                b.host = None
        pages, nbytes = pages_to_write(keys, write + ask + local, batches)
        if pages:
            self.write_behind.submit(
                lambda wait_idle: write_back(cache, ns, keys, write, ask, batches, layout, wait_idle, local),
                pages,
                nbytes,
            )

    def close(self) -> None:
        if self.write_behind is not None:
            self.write_behind.close()
