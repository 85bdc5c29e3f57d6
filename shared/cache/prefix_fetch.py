"""A prompt's cached pages fetched from the shared store in the background, racing the engine that computes them.

    fetch = PrefixFetch(cache, ns, keys, first_page, end_page, device=..., prefill_tokens_per_s=...).start()
    fetch.landed                         pages [first_page, landed) arrived, verified (MAC, CRC, values), usable
    fetch.wait(page_end, timeout_s)      until pages up to `page_end` landed, the fetch ended, or the timeout
    fetch.usable_end(page)               end of the landed pages usable from `page` (skipped ones are not)
    fetch.take(start, end)               pages [start, end) for the engine: host views and, on CUDA, device copies
    fetch.skip_to(page)                  the compute covers the pages before `page`: their batches are not fetched
    fetch.mark_loaded(start, end)        the engine loaded them; `take_loaded()` lists them once (to ship them)
    fetch.finished                       no more pages will land
    fetch.verified_pages()               pages read and verified, and the page a miss or failed check ended it at
    fetch.cancel()                       the engine went past the fetched range (or the request ended): stop

The engine (`pdserve.engine.prefix_fetch`) polls it at each step start: a page range that landed before the
engine reached it is loaded instead of computed; the rest is computed and its fetched copy discarded. So a hit
never costs more than computing, however slow the store.

Speed: the pages are split in batches of `batch_pages`, fetched on the cache's fetch threads (one pooled Redis
connection each) as pipelined GETEX whose values are read from the socket straight into one arena (pinned host
memory when `device` is CUDA: `resp_fetch.getex_into`), slot by slot, the page data of each slot 256-byte aligned.
Each value's MAC and checksum are checked on the thread that read it (hashlib and crc32c release the GIL). With
the cache's helper process (`fetch_process`, GPU engines), the reads and every check run there instead, into a
block of its shared arena, and the fetch thread builds no views either: a page verified in its slot is listed by
index, its views made by `take` on the engine's thread (on CUDA the first page's alone), since each view op on a
fetch thread hands the GIL over while the engine thread launches a prefill's kernels (the convoy of
`pdserve.server.gil`). Nor does a fetch copy pages into the local tier: the request's write-back gives it the
pages the fetch verified, from the rows shipped to decode (`PrefixPlan.fetched_pages`). On CUDA the batch is
then copied to a device arena on a side stream, and `take` hands the engine device tensors (its stream waits on
that copy's event). The fetch starts at `split_page`, where computing and fetching take about as long (the
engine's chunk stops there). Batches land in page order: a page that is absent, fails its MAC or its checks ends the
fetch there (those after it are useless: a prefix is used from its start).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.cache.fetch_process import FetchRow
from pdserve.cache.keys import CacheNamespace
from pdserve.cache.store import StoreError, get_many_into
from pdserve.cache.value import (
    block_checks,
    checked_page,
    expected_header,
    value_blocks,
    value_bytes,
    value_header_bytes,
)
from pdserve.cache.value_auth import TAG_BYTES
from pdserve.kv.payload import CachedUpload, PagePayload

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.cache.breaker import CircuitBreaker
    from pdserve.cache.fetch_arena import ArenaBlock
    from pdserve.cache.fetch_process import FetchProcess
    from pdserve.cache.local_tier import LocalTier
    from pdserve.cache.stats import CacheStats
    from pdserve.cache.store import PageStore
    from pdserve.cache.value_auth import CacheKeyring
    from pdserve.telemetry.rates import WorkRate


class PromptCache(Protocol):
    """What a fetch uses of `pdserve.cache.prompt_cache.PromptCache` (a structural type: that module imports this
    one, so it is not imported back)."""

    store: PageStore
    keyring: CacheKeyring
    ttl_ms: int
    local: LocalTier | None
    max_value_bytes: int
    breaker: CircuitBreaker
    key_prefix: str
    fetch_rate: WorkRate
    stats: CacheStats
    fetch_process: FetchProcess | None

    def _open(self, ns: CacheNamespace, digest: bytes, page_index: int, found: list, checked: bool = ...) -> tuple: ...
    def measured_fetch(self, nbytes: int, seconds: float, page_value_bytes: float) -> None: ...
    def fetch_pool(self) -> ThreadPoolExecutor: ...
    def copy_stream(self, device: torch.device) -> torch.cuda.Stream: ...
    def rekey(self, ns: CacheNamespace, digest: bytes, page: PagePayload, value: bytes | memoryview) -> bool: ...


log = logging.getLogger("pdserve.cache")
ALIGN = 256  # a slot's page data starts on this boundary (device views of any dtype)
OVERDUE_SHARE = 0.1  # `expected_landing_s` before any batch landed: the least share of its predicted time left
# A prefill forward's time that does not shrink with its tokens (the weights read, launches), as a share of a whole
# chunk's: a chunk cut part-way by `split_page` costs that much more than its pages' share of the measured rate.
# With the prefill CUDA graphs a short forward's cost is a small fraction of a whole chunk's (measured in
# docs/benchmarks.md, "One GPU"); the share rounds that up, so a cut must win clearly.
PART_FORWARD_SHARE = 0.2


@dataclass
class LandedPages:
    """Pages from `first` for the engine: `payloads` (host views, page_index set) and, when the fetch runs for a
    CUDA engine, `upload` (the same pages stacked on the device, ready on the engine's stream). Taken with
    `host_views=False`, a fetch with an `upload` lists the first page's views alone (every page of a fetch has its
    namespace's layout: one page checks it)."""

    first: int
    payloads: list[PagePayload]
    upload: CachedUpload | None = None


@dataclass
class _Batch:
    start: int  # first page index
    # the leading pages of the batch that verified (fewer: a miss ends the fetch); a page index: verified whole in
    # its arena slot by the helper, its views made when it is taken
    payloads: list[PagePayload | int]
    nbytes: int
    event: object | None = None  # torch.cuda.Event of its device copy
    failed: bool = False  # store error
    skipped: int = 0  # pages not fetched: the compute was past them when the batch's turn came (`skip_to`)


class PrefixFetch:
    """Pages [first_page, end_page) of a prompt (chain digests `keys[i]` for page i) from `cache`'s store, in `ns`.
    `device`: the engine's (CUDA: pinned arena + device copies); `prefill_tokens_per_s`: the engine's measured
    rate (None: unmeasured), with `fetch_bytes_per_s` (the cache's measured fetch rate) what the engine weighs
    before waiting for pages instead of computing them; `local_pages`: pages before `first_page` the local tier
    served (counted with this fetch's figures in the cache's stats); `chunk_pages`: pages of one prefill chunk of
    the engine (0: unknown), for `split_page`."""

    def __init__(
        self,
        cache: PromptCache,
        ns: CacheNamespace,
        keys: Sequence[bytes],
        first_page: int,
        end_page: int,
        *,
        device: torch.device | str = "cpu",
        batch_pages: int = 8,
        prefill_tokens_per_s: float | None = None,
        local_pages: int = 0,
        chunk_pages: int = 0,
    ):
        if not 0 <= first_page <= end_page <= len(keys):
            raise ValueError(f"page range [{first_page}, {end_page}) outside the prompt's {len(keys)} pages")
        self.cache, self.ns, self.keys = cache, ns, list(keys)
        self.first_page, self.end_page = first_page, end_page
        self.device = torch.device(device)
        self.batch_pages = max(1, batch_pages)
        self.page_size = ns.layout.page_size
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.local_pages = local_pages
        self.chunk_pages = max(0, chunk_pages)
        self.fetch_bytes_per_s = cache.fetch_rate.rate()  # before this fetch: what the store delivered lately
        self.value_bytes = value_bytes(ns, 0)  # stored value (with its MAC tag) of one page
        self._header = value_header_bytes(ns)
        self._block_checks = block_checks(ns.layout)  # what the helper checks of each value's blocks
        self._pad = -self._header % ALIGN
        self._stride = -(-(self._pad + self.value_bytes) // ALIGN) * ALIGN
        self._cv = threading.Condition()
        self._batches: dict[int, _Batch] = {}  # by batch number, until they land in order
        self._next_batch = 0
        # landed, in order: pages first_page .. landed - 1 (None: skipped; an int: in its arena slot, `_Batch`)
        self._pages: list[PagePayload | int | None] = []
        self._events: list[tuple[int, int, object]] = []  # (first page, page end, its device copy event) per batch
        self.skip_before = first_page  # batches wholly before this page are not fetched (`skip_to`)
        self.landed = first_page
        self.real_pages = 0  # of the landed pages, those fetched (not skipped)
        self.finished = first_page >= end_page
        self.cancelled = False
        self.stop_page: int | None = None  # where a miss, a failed check or a store error ended the fetch
        self.landed_bytes = 0
        self.started = 0.0
        self.landed_s = 0.0  # seconds from start until the last batch landed
        self._host: torch.Tensor | None = None  # uint8 [pages * stride] (pinned on CUDA)
        self._dev: torch.Tensor | None = None  # its device copy (CUDA)
        self._stream: torch.cuda.Stream | None = None
        self._counts = dict(mac_failures=0, corrupt=0, errors=0, rekeyed=0)
        self._loaded: list[int] = []  # page indexes the engine loaded from this fetch, not yet shipped
        self._stats_done = False
        self.probe_waited_s = 0.0  # engine thread: what the engine waited for it while a rate was unknown
        self._proc: FetchProcess | None = getattr(cache, "fetch_process", None)  # the helper process, if one runs
        self._block: ArenaBlock | None = None  # the host arena's block of the helper's shared arena (None: own)
        self._inflight = 0  # batches reading into the host arena now
        self._closed = False
        self._base = first_page  # first page the arenas hold (batches wholly before `split_page` are never fetched)
        self.start_page = first_page  # where the fetch started (`split_page`)
        self.waited_s = 0.0  # what the engine waited in `wait`
        self.loaded_pages = 0  # pages the engine loaded
        self._landed_ms: list[float] = []  # when each fetched batch landed, ms from the start

    # ---- lifecycle ---------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.end_page - self.first_page

    def verified_pages(self) -> tuple[set[int], int | None]:
        """(the pages read from the store and verified so far, the page where a miss, a failed check or a store
        error ended the fetch: None if none did). The other pages of [first_page, end_page) were never read
        (skipped: the compute covered them; after the fetch was cancelled): the store may hold them or not."""
        with self._cv:
            got = {self.first_page + i for i, p in enumerate(self._pages) if p is not None}
            return got, self.stop_page

    def split_page(self) -> int:
        """Where the fetch starts: the engine computes from `first_page` up to here (its chunk stops here:
        `Sequence.prefill_stop`) while the fetch lands the pages after it; a page both fetch and compute cover is
        work lost. So with both rates measured the fetch starts at the chunk boundary or batch edge that minimises
        max(compute of the pages before it, fetch of the pages after it) (`_split_cost`; the fetch always has pages
        left: it keeps measuring the store); of equal ones, the split that cuts no chunk. Without both rates, after
        the first chunk (which the engine computes anyway while a first batch probes the store), or at `first_page`
        when the span is one chunk or the chunk is unknown."""
        c, n = self.chunk_pages, self.num_pages
        compute, fetch = self.prefill_tokens_per_s, self.fetch_bytes_per_s
        if c <= 0 or n == 0 or ((not compute or not fetch) and n <= c):
            return self.first_page
        if not compute or not fetch:
            return self.first_page + c
        page_s, value_s = self.page_size / compute, self.value_bytes / fetch
        fixed, b = PART_FORWARD_SHARE * c * page_s, self.batch_pages
        candidates = set(range(0, n, c))  # chunk boundaries, then in each chunk the batch edges around the balance
        for f in range(1, -(-n // c) + 1):  # chunk f: pages ((f-1)c, fc), computed as k*page_s + fixed*(f - k/c)
            k = (n * value_s - fixed * f) / (page_s - fixed / c + value_s)
            edges = (math.floor(k / b) * b, math.ceil(k / b) * b)
            candidates.update(p for p in edges if (f - 1) * c < p < min(f * c, n))
        best = min(candidates, key=lambda k: (self._split_cost(k, page_s, value_s, fixed), k % c != 0, k))
        return self.first_page + best

    def _split_cost(self, k: int, page_s: float, value_s: float, fixed: float) -> float:
        """Seconds until both halves of a split at `k` pages are in: the compute of pages [0, k), a chunk cut
        part-way paying its forward's fixed cost for the pages it does not compute, and the fetch from the batch
        that holds page `k` on."""
        c, part = self.chunk_pages, k % self.chunk_pages
        compute = k * page_s + (fixed * (1 - part / c) if part else 0.0)
        return max(compute, (self.num_pages - k // self.batch_pages * self.batch_pages) * value_s)

    def start(self) -> PrefixFetch:
        """Queue the fetch on the cache's fetch threads (returns at once: the arenas are allocated there too),
        from `split_page` on."""
        self.started = time.perf_counter()
        self.skip_to(self.split_page())
        self.start_page = self.skip_before
        skipped = min(self.skip_before, self.end_page) - self.first_page  # its batches wholly before it: never read
        self._base = self.first_page + skipped // self.batch_pages * self.batch_pages
        if not self.finished:
            self.cache.fetch_pool().submit(self._prepare)
        return self

    def _prepare(self) -> None:
        """Fetch thread: the arenas (the host one in the helper process's shared arena when it runs and has
        room), then one job per batch."""
        block = proc = None
        try:
            n = self.end_page - self._base  # the arenas hold the pages from the first batch fetched on
            pinned = self.device.type == "cuda"
            proc = self._proc
            if proc is not None:
                if not proc.ready():
                    proc.fell_back("helper_down")
                else:
                    block = proc.arena.alloc(n * self._stride)
                    if block is None:
                        proc.fell_back("arena_full")
            if block is not None:
                host = block.tensor  # [pages * stride] (pinned on CUDA)
            else:
                host = torch.empty(n * self._stride, dtype=torch.uint8, pin_memory=pinned)  # [pages * stride]
            if pinned:
                self._stream = self.cache.copy_stream(self.device)
                with torch.cuda.stream(self._stream):
                    self._dev = torch.empty(n * self._stride, dtype=torch.uint8, device=self.device)
        except Exception:
            log.exception("prompt cache: prefix fetch arena")
            if block is not None and proc is not None:
                proc.arena.release(block)
            with self._cv:
                self._finish_locked()
            return
        with self._cv:
            self._block = block
            if self.finished:
                self._dev = None
                self._release_block_locked()
                return
            self._host = host
        pool = self.cache.fetch_pool()
        for b, start in enumerate(range(self.first_page, self.end_page, self.batch_pages)):
            pool.submit(self._run_batch, b, start, min(start + self.batch_pages, self.end_page))

    def cancel(self) -> None:
        """No more pages are wanted: batches not started are skipped, the arenas released once none runs."""
        with self._cv:
            if self.cancelled:
                return
            self.cancelled = True
            self._finish_locked()

    def span_attributes(self) -> dict[str, int | float | list[float]]:
        """The fetch so far, for the request's span: where it started, pages fetched and loaded, what the engine
        waited, when its last batch and each batch landed (ms from its start), the store rate its split assumed."""
        with self._cv:
            return {
                "pdserve.cache.fetch_start_page": self.start_page,
                "pdserve.cache.fetch_pages_fetched": self.real_pages,
                "pdserve.cache.fetch_pages_loaded": self.loaded_pages,
                "pdserve.cache.fetch_wait_ms": round(self.waited_s * 1e3, 2),
                "pdserve.cache.fetch_landed_ms": round(self.landed_s * 1e3, 2),
                "pdserve.cache.fetch_batches_landed_ms": list(self._landed_ms),
                "pdserve.cache.fetch_split_gbps": round((self.fetch_bytes_per_s or 0.0) / 1e9, 3),
            }

    # ---- engine side ---------------------------------------------------------------------------------------
    def wait(self, page_end: int, timeout_s: float) -> int:
        """Until pages up to `page_end` landed, the fetch finished, or `timeout_s`: returns `landed`."""
        t0 = time.monotonic()
        deadline = t0 + max(0.0, timeout_s)
        with self._cv:
            while self.landed < min(page_end, self.end_page) and not self.finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            self.waited_s += time.monotonic() - t0
            return self.landed

    def expected_landing_s(self, page_end: int, from_page: int = 0) -> float | None:
        """Seconds until the pages from `from_page` (and what landed or is skipped) up to `page_end` land, at the
        rate this fetch runs so far (a stall lowers it); before its first batch lands, what is left of the time its
        span from `start_page` takes at the store's recent rate (at least `OVERDUE_SHARE` of it); 0 when they
        landed or never will; None while no rate is known."""
        with self._cv:
            missing = max(0, min(page_end, self.end_page) - max(self.landed, self.skip_before, from_page))
            if self.finished or not missing:
                return 0.0
            elapsed = max(self.landed_s, time.perf_counter() - self.started) if self.started else 0.0
            if self.landed_bytes and elapsed > 0:  # this fetch's own rate so far
                return missing * self.value_bytes / (self.landed_bytes / elapsed)
            if not self.fetch_bytes_per_s:
                return None
            # Nothing landed yet: its batches are in flight together (one a connection), so its pages land about
            # when its whole span does at the store's recent (whole-fetch) rate, counted from its start, not from
            # now. One overdue still takes a share of that span's time (a stall is no landing "now").
            span_s = (min(page_end, self.end_page) - self.start_page) * self.value_bytes / self.fetch_bytes_per_s
            return max(span_s - elapsed, OVERDUE_SHARE * span_s)

    def take(self, start: int, end: int, host_views: bool = True) -> LandedPages:
        """Landed pages [start, end) for loading (engine thread): host views, and on CUDA their device copy
        stacked page-major, the current stream made to wait for its arrival. `host_views=False`: with a device
        copy, the first page's host views alone (`LandedPages`)."""
        with self._cv:
            if not self.first_page <= start <= end <= self.landed:
                raise ValueError(f"pages [{start}, {end}) not landed (landed: [{self.first_page}, {self.landed}))")
            pages = self._pages[start - self.first_page : end - self.first_page]
            if any(p is None for p in pages):
                raise ValueError(f"pages [{start}, {end}) include skipped ones")
            events = [ev for first, page_end, ev in self._events if page_end > start and first < end]
            dev, host = self._dev, self._host
        if dev is not None and not host_views:
            pages = pages[:1]
        if any(isinstance(p, int) for p in pages):
            assert host is not None, "a fetch's pages are taken before it is closed"
            pages = [checked_page(self._slot(host, p), self.ns, p) if isinstance(p, int) else p for p in pages]
        upload = None
        if dev is not None and pages:
            cur = torch.cuda.current_stream(self.device)
            for ev in events:
                cur.wait_event(ev)  # type: ignore[arg-type]
            dev.record_stream(cur)
            upload = self._device_pages(dev, start, end)
        return LandedPages(start, pages, upload)  # type: ignore[arg-type]

    def usable_end(self, page: int) -> int:
        """End of the landed pages usable from `page` on (`page`: none)."""
        with self._cv:
            end = page
            while end < self.landed and self._pages[end - self.first_page] is not None:
                end += 1
            return end

    def skip_to(self, page: int) -> None:
        """The compute covers the pages before `page`: batches wholly before it that have not started are skipped."""
        with self._cv:
            self.skip_before = max(self.skip_before, page)

    def mark_loaded(self, start: int, end: int) -> None:
        """The engine loaded pages [start, end) (engine thread): listed for `take_loaded`."""
        with self._cv:
            self._loaded.extend(range(start, end))
            self.loaded_pages += end - start

    def take_loaded(self) -> list[int]:
        """Page indexes the engine loaded from this fetch since the last call (the caller ships them)."""
        with self._cv:
            out, self._loaded = self._loaded, []
            return out

    def _device_pages(self, arena: torch.Tensor, start: int, end: int) -> CachedUpload:
        """Pages [start, end) of an arena (the device one; any, for tests) as stacked tensors [N, 2, L, page_size, H,
        D (or D/g)]: one strided view per block and one copy kernel each (slots and blocks are aligned)."""
        out: list[torch.Tensor | None] = []
        at = (start - self._base) * self._stride + self._pad + self._header
        for size, dtype, shape in value_blocks(self.ns.layout):
            if not size:
                out.append(None)
                continue
            itemsize = torch.empty((), dtype=dtype).element_size()
            inner = torch.empty(shape, dtype=dtype, device="meta").stride()
            typed = arena.view(dtype)  # the arena is a whole number of aligned slots
            view = typed.as_strided((end - start, *shape), (self._stride // itemsize, *inner), at // itemsize)
            out.append(view.contiguous())
            at += size
        return CachedUpload(out[0], out[1], out[2])  # type: ignore[arg-type]

    # ---- fetch threads -----------------------------------------------------------------------------------
    def _slot(self, host: torch.Tensor, page: int) -> memoryview:
        o = (page - self._base) * self._stride + self._pad
        return memoryview(host[o : o + self.value_bytes].numpy())  # type: ignore[arg-type]

    def _run_batch(self, b: int, start: int, end: int) -> None:
        with self._cv:
            host = None if self.finished else self._host
            skip = end <= self.skip_before
            if host is not None and not skip:
                self._inflight += 1
        batch = _Batch(start, [], 0, skipped=end - start if skip else 0)
        if host is not None and not skip:
            try:
                batch = self._fetch(host, start, end)
            except Exception as e:  # a store error (or a bug): the fetch ends; the engine computes the rest
                if not isinstance(e, StoreError):
                    log.exception("prompt cache: prefix fetch failed")
                batch = _Batch(start, [], 0, failed=True)
        self._land(b, batch)
        if host is not None and not skip:
            with self._cv:
                self._inflight -= 1
                self._release_block_locked()

    def _fetch(self, host: torch.Tensor, start: int, end: int) -> _Batch:
        cache, ns = self.cache, self.ns
        if not cache.breaker.allow():
            raise StoreError("circuit breaker open")
        n_keys = len(cache.keyring.keys)
        digests = self.keys[start:end]
        names = [n for k in digests for n in cache.keyring.names(cache.key_prefix, k)]
        try:
            checked = self._block is not None and self._proc is not None  # the helper checked the values whole
            if checked:
                lens, values = self._get_in_helper(self._proc, self._block, host, start, digests, names)  # type: ignore[arg-type]
            else:
                lens, values = self._get_here(host, start, digests, names)
        except StoreError as e:
            cache.breaker.failure()
            log.warning("prompt cache prefix fetch failed (pages computed instead): %s", e)
            with self._cv:
                self._counts["errors"] += 1
            raise
        cache.breaker.success()
        pages: list[PagePayload | int] = []
        nbytes = sum(n for n in lens if n is not None)
        for j, digest in enumerate(digests):
            page = start + j
            if values[j * n_keys] is True:  # verified whole in its slot (`_get_in_helper`)
                pages.append(page)  # no views here: each view op hands the GIL over
                continue
            found = values[j * n_keys : (j + 1) * n_keys]
            p, value, key_index, bad = cache._open(ns, digest, page, found, checked)
            with self._cv:
                self._counts["mac_failures"] += bad[0]
                self._counts["corrupt"] += bad[1]
            if p is None:
                break
            if key_index > 0:  # under a previous secret: not in the arena (written into its slot for the device)
                p = _copied(p)
                if cache.rekey(ns, digest, p, value):
                    with self._cv:
                        self._counts["rekeyed"] += 1
            pages.append(p)
        batch = _Batch(start, pages, nbytes)
        dev = self._dev
        if self._stream is not None and pages and dev is not None:
            batch.event = self._to_device(host, dev, start, start + len(pages), pages)
        return batch

    def _get_here(
        self, host: torch.Tensor, start: int, digests: list[bytes], names: list[bytes]
    ) -> tuple[list[int | None], list[memoryview | bool | str | None]]:
        """Values of `names` read on this thread into their arena slots (other sizes, and values under a previous
        secret, into buffers of their own), MAC-checked here: (lengths, value / False (MAC) / None (absent))."""
        cache = self.cache
        keyring = cache.keyring
        n_keys = len(keyring.keys)
        extra: dict[int, memoryview] = {}

        def dest(i: int, n: int) -> memoryview | None:
            page, key_index = start + i // n_keys, i % n_keys
            if key_index == 0 and n == self.value_bytes:
                return self._slot(host, page)
            extra[i] = memoryview(bytearray(n))
            return extra[i]

        lens = get_many_into(cache.store, names, cache.ttl_ms, dest, cache.max_value_bytes)
        values: list[memoryview | bool | str | None] = []
        for i, n in enumerate(lens):
            if n is None:
                values.append(None)
                continue
            stored = extra[i] if i in extra else self._slot(host, start + i // n_keys)
            value = keyring.keys[i % n_keys].verify(digests[i // n_keys], stored)
            values.append(False if value is None else value)
        return lens, values

    def _get_in_helper(
        self,
        proc: FetchProcess,
        block: ArenaBlock,
        host: torch.Tensor,
        start: int,
        digests: list[bytes],
        names: list[bytes],
    ) -> tuple[list[int | None], list[memoryview | bool | str | None]]:
        """`_get_here`'s answer from the helper process: it reads the values into this fetch's block of the
        shared arena (others come back in its reply), checks their MACs and then each value whole (header, length,
        CRC, values: what `decode_value` checks); a corrupt value's slot holds the reason. A verified
        value in its arena slot (the current secret's, full size) is True, not a view (made by `take`)."""  # fmt: skip
        cache = self.cache
        n_keys = len(cache.keyring.keys)
        rows = []
        for i, name in enumerate(names):
            page, key_index = start + i // n_keys, i % n_keys
            at = block.offset + (page - self._base) * self._stride + self._pad if key_index == 0 else -1
            header = expected_header(self.ns, digests[i // n_keys], page)
            rows.append(FetchRow(name, key_index, digests[i // n_keys], at, self.value_bytes, header))
        reply = proc.get_many(rows, cache.ttl_ms, cache.max_value_bytes, self._block_checks)
        values: list[memoryview | bool | str | None] = []
        for i, n in enumerate(reply.lens):
            ok = reply.ok[i]
            if n is None or ok is None:
                values.append(None)
            elif ok is not True:
                values.append(ok if isinstance(ok, str) else False)  # corrupt (why) / fails its MAC
            else:
                if i not in reply.extras and rows[i].offset >= 0 and n == self.value_bytes:
                    values.append(True)
                    continue
                stored = reply.extras[i] if i in reply.extras else self._slot(host, start + i // n_keys)
                values.append(stored[: n - TAG_BYTES])
        return reply.lens, values

    def _to_device(self, host: torch.Tensor, dev: torch.Tensor, start: int, end: int, pages: list[PagePayload | int]):
        """Copy the arena slots of pages [start, end) to the device arena on the side stream; its event."""
        for j, p in enumerate(pages):  # a page outside the arena (rekeyed): its bytes into its slot first
            if isinstance(p, int):  # in its slot
                continue
            at = (start + j - self._base) * self._stride + self._pad + self._header
            if p.data.data_ptr() != host.data_ptr() + at:
                self._write_slot(host, at, p)
        a, b = (start - self._base) * self._stride, (end - self._base) * self._stride
        with torch.cuda.stream(self._stream):
            dev[a:b].copy_(host[a:b], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._stream)
        return ev

    @staticmethod
    def _write_slot(host: torch.Tensor, at: int, p: PagePayload) -> None:
        for t in (p.data, p.scales, p.zeros):
            if t is None:
                continue
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            host[at : at + raw.numel()].copy_(raw)
            at += raw.numel()

    def _land(self, b: int, batch: _Batch) -> None:
        """Batches land in order: the next ones that completed join `landed`; a short or failed one ends it."""
        with self._cv:
            self._batches[b] = batch
            while not self.finished and self._next_batch in self._batches:
                got = self._batches.pop(self._next_batch)
                self._next_batch += 1
                if got.skipped:
                    self._pages.extend([None] * got.skipped)
                    self.landed += got.skipped
                    if self.landed >= self.end_page:
                        self._finish_locked()
                    continue
                self._pages.extend(got.payloads)
                self.real_pages += len(got.payloads)
                self.landed += len(got.payloads)
                self.landed_bytes += got.nbytes
                self.landed_s = time.perf_counter() - self.started
                self._landed_ms.append(round(self.landed_s * 1e3, 1))
                if got.event is not None:
                    self._events.append((got.start, self.landed, got.event))
                full = min(got.start + self.batch_pages, self.end_page) - got.start
                if got.failed or len(got.payloads) < full:
                    self.stop_page = got.start + len(got.payloads)
                if self.stop_page is not None or self.landed >= self.end_page:
                    self._finish_locked()
            self._cv.notify_all()

    def _finish_locked(self) -> None:
        self.finished = True
        self._cv.notify_all()
        if self._stats_done:
            return
        self._stats_done = True
        cache, ns = self.cache, self.ns
        cache.measured_fetch(self.landed_bytes, self.landed_s, float(self.value_bytes))
        c, hits = self._counts, self.local_pages + self.real_pages
        cache.stats.add(
            lookups=1,
            lookup_pages=self.local_pages + self.num_pages,
            hits=hits,
            local_hits=self.local_pages,
            mac_failures=c["mac_failures"],
            corrupt=c["corrupt"],
            errors=c["errors"],
            rekeyed=c["rekeyed"],
        )
        cache.stats.add_scope(ns.scope, self.local_pages + self.num_pages, hits)

    def close(self) -> None:
        """Release the arenas (the request ended or every wanted page was loaded)."""
        self.cancel()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "prefix fetch: pages [%d, %d) from %d: %d fetched (%.0f MB), batches landed at %s ms; the engine "
                "waited %.1f ms and loaded %d pages",
                self.first_page, self.end_page, self.skip_before, self.real_pages, self.landed_bytes / 1e6,
                self._landed_ms, self.waited_s * 1e3, self.loaded_pages,
            )  # fmt: skip
        with self._cv:
            self._host = self._dev = None
            self._closed = True
            self._release_block_locked()

    def _release_block_locked(self) -> None:
        """The helper's arena block back to it once the fetch is closed and no batch reads into it (on CUDA after
        its copies to the device ran: the side stream's event)."""
        proc, block = self._proc, self._block
        if block is None or proc is None or not self._closed or self._inflight:
            return
        self._block = None
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
        proc.arena.release(block, event)


def _copied(p: PagePayload) -> PagePayload:
    """`p` with tensors of its own (not views of a fetch arena or of a store value)."""
    scales = None if p.scales is None else p.scales.clone()
    zeros = None if p.zeros is None else p.zeros.clone()
    return PagePayload(p.page_index, p.num_tokens, p.layer_start, p.data.clone(), scales, zeros, p.group_size)
