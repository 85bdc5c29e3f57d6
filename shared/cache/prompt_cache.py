"""PromptCache: KV pages of prompt prefixes, looked up by chained page keys, shared through a store.

    lookup(ns, prompt, max_pages, prefill_tokens_per_s)
                                    longest cached prefix of full pages: local tier first, then the store in
                                    pipelined batches, stopping at the first miss (or corrupt value); the store
                                    only where fetching beats computing at the measured rates (fetch_policy.py),
                                    or to measure it again when its last measurement is old
    lookup_racing(ns, prompt, max_pages, prefill_tokens_per_s, device)
                                    the local tier's prefix now, and the store's pages after it as a PrefixFetch
                                    running in the background (prefix_fetch.py): the engine loads the pages that
                                    land before it reaches them and computes the rest
    put(ns, key, payload)           a newly computed full page: into the local tier now, into the store by the
                                    write-back thread (never blocks; dropped and counted when the queue is full)

Store keys and values are keyed with the deployment's cache secret (`keyring`, value_auth.py): a page's key name
is a keyed hash of its chain digest, and its value carries a MAC over the digest and the whole value. A lookup
asks for a page's name under every accepted secret (one name outside a rotation); a value written under a
previous secret is read and written again under the current one (`rekeyed`).

Failure policy: a store error or timeout makes the rest of that lookup a miss and feeds the circuit breaker;
while the breaker is open the store is not called at all (lookups are local-tier only, writes are dropped), and
after its cooldown one probe decides whether the store is back. A value whose MAC does not verify is a miss,
counted in `mac_failures` (a forgery or damage); one that verifies but fails parsing or its checksum is a miss
counted in `corrupt`; either way the page is recomputed and written again, which replaces the bad value.

Counters for metrics: `hits`, `misses`, `local_hits`, `mac_failures`, `corrupt`, `errors`, `write_drops` (pages),
`hit_ratio()`, `local_hit_ratio()`, and `stats.snapshot()` for all of them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import torch

from pdserve.cache.breaker import CircuitBreaker
from pdserve.cache.config import CacheOptions, MiB
from pdserve.cache.fetch_policy import FetchDecision, decide_fetch
from pdserve.cache.keys import CacheNamespace
from pdserve.cache.local_tier import LocalTier
from pdserve.cache.prefix_fetch import PrefixFetch
from pdserve.cache.stats import CacheStats
from pdserve.cache.store import MemoryStore, PageStore, StoreError, get_many_into
from pdserve.cache.value import checked_page, decode_value, encode_value
from pdserve.cache.value_auth import CacheKeyring, keyring_from
from pdserve.cache.writer import WriteBack
from pdserve.errors import CorruptPage, InvalidRequest
from pdserve.kv.bytes_out import concat
from pdserve.kv.payload import PagePayload
from pdserve.server.tls import is_loopback
from pdserve.telemetry.rates import WorkRate

if TYPE_CHECKING:
    from pdserve.cache.fetch_process import FetchProcess

log = logging.getLogger("pdserve.cache")
PARALLEL_VERIFY_BYTES = 4 * MiB  # a batch of stored values at least this large is MAC-checked on several threads


@dataclass
class CacheLookup:
    keys: list[bytes]  # chain digests of every full page of the prompt (what put() needs)
    pages: list[PagePayload]  # cached prefix: pages 0 .. len(pages) - 1, full, all layers
    local_hits: int = 0  # of `pages`, served by the local tier
    decision: FetchDecision | None = None  # whether the store was asked for what the local tier lacked

    @property
    def num_pages(self) -> int:
        return len(self.pages)


@dataclass
class _Write:
    ns: CacheNamespace
    key: bytes
    payload: PagePayload
    value: bytes | memoryview | None = None  # encoded already (`value.encode_row`), else encoded by the writer


@dataclass
class _Touch:
    store_keys: list[bytes]


class PromptCache:
    def __init__(
        self,
        store: PageStore,
        *,
        ttl_s: float = 1800.0,
        local_bytes: int = 0,
        max_value_bytes: int = 32 * MiB,
        write_queue: int = 1024,
        lookup_batch: int = 32,
        breaker: CircuitBreaker | None = None,
        key_prefix: str = "pdserve:kv:",
        keyring: CacheKeyring | None = None,
        fetch_connections: int = 8,
        fetch_batch_pages: int = 8,
    ):
        """`keyring`: the deployment's cache secrets (None: a random one, private to this cache);
        `fetch_connections`: store connections (threads) of the background prefix fetches, `fetch_batch_pages`
        pages each fetches per pipelined round trip."""
        self.store = store
        self.keyring = keyring or CacheKeyring.generate()
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.local = LocalTier(local_bytes) if local_bytes > 0 else None
        self.max_value_bytes = max_value_bytes
        self.lookup_batch = lookup_batch
        self.breaker = breaker or CircuitBreaker()
        self.key_prefix = key_prefix
        self.stats = CacheStats()
        self._writer: WriteBack[_Write | _Touch] = WriteBack(self._write_batch, write_queue)
        self._verify_pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="cache-verify")
        self.fetch_rate = WorkRate(min_seconds=1e-3)  # store value bytes per second of fetching (remote stores)
        self.page_value_bytes = 0.0  # stored size of a page, from the last fetch (0: none yet)
        self.fetch_measured_at: float | None = None  # time.monotonic() of the last fetch measurement
        self.fetch_connections, self.fetch_batch_pages = max(1, fetch_connections), max(1, fetch_batch_pages)
        self._fetch_pool: ThreadPoolExecutor | None = None
        self._fetch_lock = threading.Lock()
        self.fetch_process: FetchProcess | None = None  # the prefix fetches' helper process (`use_fetch_process`)
        self._copy_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}

    # ---- counters (for metrics) ------------------------------------------------------------------------
    hits = property(lambda self: self.stats.hits)
    misses = property(lambda self: self.stats.misses)
    local_hits = property(lambda self: self.stats.local_hits)
    corrupt = property(lambda self: self.stats.corrupt)
    mac_failures = property(lambda self: self.stats.mac_failures)
    errors = property(lambda self: self.stats.errors)
    write_drops = property(lambda self: self.stats.write_drops)

    def hit_ratio(self) -> float:
        return self.stats.hit_ratio()

    def local_hit_ratio(self) -> float:
        return self.stats.local_hit_ratio()

    # ---- keys --------------------------------------------------------------------------------------------
    def store_key(self, ns: CacheNamespace, digest: bytes) -> bytes:
        """The store's key of the page with chain digest `digest` (of a prompt in `ns`): prefix + a keyed hash of
        the digest under the current cache secret (the digest already pins `ns`)."""
        return self.keyring.current.name(self.key_prefix, digest)

    def _get_many(self, names: list[bytes]) -> list[bytes | bytearray | None]:
        """The stored values of `names` (None: absent): a remote store's read straight into one buffer each
        (`store.get_many_into`), skipping redis-py's parser and its copies."""
        if not self.store.remote:
            return list(self.store.get_many(names, self.ttl_ms))
        bufs: list[bytearray | None] = [None] * len(names)

        def dest(i: int, n: int) -> memoryview:
            bufs[i] = bytearray(n)
            return memoryview(bufs[i])  # type: ignore[arg-type]

        lens = get_many_into(self.store, names, self.ttl_ms, dest, self.max_value_bytes)
        return [b if n is not None else None for b, n in zip(bufs, lens)]

    def _verify(self, batch: list[bytes], stored: list[bytes | bytearray | None]) -> list[memoryview | bool | None]:
        """MAC check of `stored` (the values of each digest of `batch` under each accepted key, current first):
        per slot None (absent), False (fails its MAC) or the value. Large batches are checked on the verify
        threads (hashlib releases the GIL), so a long cached prefix costs its hashing time / cores."""
        n = len(self.keyring.keys)
        jobs = [(i, v) for i, v in enumerate(stored) if v is not None]

        def check(job: tuple[int, bytes | bytearray]) -> memoryview | bool:
            i, v = job
            value = self.keyring.keys[i % n].verify(batch[i // n], v)
            return False if value is None else value

        big = len(jobs) > 1 and sum(len(v) for _, v in jobs) >= PARALLEL_VERIFY_BYTES
        out: list[memoryview | bool | None] = [None] * len(stored)
        for (i, _), result in zip(jobs, self._verify_pool.map(check, jobs) if big else map(check, jobs)):
            out[i] = result
        return out

    def _open(self, ns: CacheNamespace, digest: bytes, page_index: int, found: list, checked: bool = False) -> tuple:
        """The page of the first of `found` (`_verify`'s slots of `digest`, one per accepted key, current first)
        that verified and parses, as (page, its value, key index, bad) or (None, None, -1, bad); `bad`: [MAC
        failures, corrupt values] met on the way. `checked`: the values were checked whole already (the fetch
        helper; a slot holding a str is a value it found corrupt, and why)."""
        bad = [0, 0]
        for i, value in enumerate(found):
            if value is None:
                continue
            if value is False:
                bad[0] += 1
                log.warning("prompt cache: value of page %d fails its MAC (treated as a miss)", page_index)
                continue
            try:
                if isinstance(value, str):
                    raise CorruptPage(value)
                page = checked_page(value, ns, page_index) if checked else decode_value(value, ns, digest, page_index)
                return page, value, i, bad
            except CorruptPage as e:
                bad[1] += 1
                log.warning("prompt cache: corrupt value for page %d (treated as a miss): %s", page_index, e)
        return None, None, -1, bad

    # ---- lookup ------------------------------------------------------------------------------------------
    def fetch_decision(self, page_size: int, prefill_tokens_per_s: float | None) -> FetchDecision:
        """Whether the store beats computing now (an in-process store always does: it is memory); a store measured
        slower is asked again once its measurement is `PROBE_AFTER_S` old (it may have been a slow moment)."""
        if not self.store.remote:
            return FetchDecision(True, "faster", 0.0, prefill_tokens_per_s or 0.0)
        age = None if self.fetch_measured_at is None else time.monotonic() - self.fetch_measured_at
        return decide_fetch(self.fetch_rate.rate(), self.page_value_bytes, page_size, prefill_tokens_per_s, age)

    def measured_fetch(self, nbytes: int, seconds: float, page_value_bytes: float) -> None:
        """One fetch's figures: `nbytes` of store values in `seconds` (wall time), pages of `page_value_bytes`."""
        if nbytes > 0 and seconds > 0:
            self.fetch_rate.add(nbytes, seconds)
            self.page_value_bytes = page_value_bytes
            self.fetch_measured_at = time.monotonic()

    def fetch_pool(self) -> ThreadPoolExecutor:
        """The threads of the background prefix fetches (`fetch_connections`: one store connection each)."""
        with self._fetch_lock:
            if self._fetch_pool is None:
                self._fetch_pool = ThreadPoolExecutor(self.fetch_connections, thread_name_prefix="cache-fetch")
            return self._fetch_pool

    def copy_stream(self, device: torch.device, role: Literal["fetch", "write"] = "fetch") -> torch.cuda.Stream:
        """The side stream of the prefix fetches' copies to `device` (role "fetch"), or of the write-backs' joins and
        copies from it ("write": a fetch never queues behind a write-back's copy). One per role: their device
        buffers, allocated on it, are reused from the allocator's cache of that stream; a stream per fetch left them
        to other streams' pools, so each fetch allocated anew."""
        with self._fetch_lock:
            stream = self._copy_streams.get((device, role))
            if stream is None:
                stream = self._copy_streams[(device, role)] = torch.cuda.Stream(device)
            return stream

    def use_fetch_process(self, arena_bytes: int, pin: bool) -> bool:
        """Prefix fetches read the store in a helper process (`fetch_process`) into an `arena_bytes` shared arena
        (`pin`: registered with CUDA); only for a Redis store. False: not started (the fetch threads read here)."""
        spec = getattr(self.store, "spec", None)
        if spec is None or self.fetch_process is not None:
            return self.fetch_process is not None
        from pdserve.cache.fetch_process import FetchProcess

        try:
            proc = FetchProcess(self.store, self.keyring, self.fetch_connections, arena_bytes, pin)
        except (OSError, RuntimeError) as e:
            log.warning("prompt cache: no fetch helper process (%s): fetching in this process", e)
            return False
        self.fetch_process = proc.start()
        return True

    def rekey(self, ns: CacheNamespace, digest: bytes, page: PagePayload, value: bytes | memoryview) -> bool:
        """Write a page found under a previous secret again under the current one (asynchronously)."""
        return self._writer.submit(_Write(ns, digest, page, value))

    def lookup_racing(
        self,
        ns: CacheNamespace,
        token_ids: list[int],
        max_pages: int,
        prefill_tokens_per_s: float | None = None,
        keys: list[bytes] | None = None,
        device: torch.device | str = "cpu",
        chunk_pages: int = 0,
    ) -> tuple[CacheLookup, PrefixFetch | None]:
        """The local tier's prefix of at most `max_pages` full pages now, and a started PrefixFetch of the store's
        pages after it (None: nothing left to fetch, an in-process store, or the breaker open), for an engine on
        `device` that races it (`pdserve.engine.prefix_fetch`; `chunk_pages`: its prefill chunk, where the fetch
        starts: `PrefixFetch.split_page`). Counted in the stats when the fetch ends."""
        if not self.store.remote:
            return self.lookup(ns, token_ids, max_pages, prefill_tokens_per_s, keys), None
        keys = ns.page_keys(token_ids) if keys is None else keys
        want = keys[: max(0, max_pages)]
        pages: list[PagePayload] = self.local.get_prefix(want) if self.local is not None else []
        n_local = len(pages)
        if n_local:
            self._writer.submit(_Touch([self.store_key(ns, k) for k in want[:n_local]]))
        decision = None
        if n_local < len(want):  # always fetched: what the measured rates say only weighs the engine's waits
            d = self.fetch_decision(ns.layout.page_size, prefill_tokens_per_s)
            decision = FetchDecision(True, f"race ({d.reason})", d.fetch_tokens_per_s, d.prefill_tokens_per_s)
        fetch = None
        if n_local < len(want):
            if self.breaker.allow():
                fetch = PrefixFetch(
                    self, ns, want, n_local, len(want), device=device, batch_pages=self.fetch_batch_pages,
                    prefill_tokens_per_s=prefill_tokens_per_s, local_pages=n_local, chunk_pages=chunk_pages,
                ).start()  # fmt: skip
            else:
                self.stats.add(skipped=1)
        if fetch is None:
            self.stats.add(lookups=1, lookup_pages=len(want), hits=n_local, local_hits=n_local)
            self.stats.add_scope(ns.scope, len(want), n_local)
        return CacheLookup(keys, pages, n_local, decision), fetch

    def lookup(
        self,
        ns: CacheNamespace,
        token_ids: list[int],
        max_pages: int,
        prefill_tokens_per_s: float | None = None,
        keys: list[bytes] | None = None,
    ) -> CacheLookup:
        """Longest cached prefix of at most `max_pages` full pages of `token_ids`. Never raises for store
        trouble (that is a miss); returns within about one store timeout per batch. Past the local tier, the
        store is asked only when fetching beats computing at `prefill_tokens_per_s` (None: unmeasured)."""
        keys = ns.page_keys(token_ids) if keys is None else keys  # `keys`: the caller's ns.page_keys(token_ids)
        want = keys[: max(0, max_pages)]
        pages: list[PagePayload] = self.local.get_prefix(want) if self.local is not None else []
        n_local = len(pages)
        fetched: list[tuple[bytes, PagePayload]] = []  # store hits, into the local tier as one chain
        rekey: list[_Write] = []  # store hits under a previous secret: written again under the current one
        n_keys = len(self.keyring.keys)
        corrupt = mac_failures = errors = skipped = slow = 0
        decision = None
        if len(pages) < len(want):
            decision = self.fetch_decision(ns.layout.page_size, prefill_tokens_per_s)
            slow = int(not decision.fetch)
            if slow:
                log.debug(
                    "prompt cache: store skipped for %d pages (it delivers %.0f tokens/s, prefill computes %.0f)",
                    len(want) - len(pages),
                    decision.fetch_tokens_per_s,
                    decision.prefill_tokens_per_s,
                )
        while len(pages) < len(want) and not slow:
            if not self.breaker.allow():
                skipped += 1
                break
            batch = want[len(pages) : len(pages) + self.lookup_batch]
            t0 = time.perf_counter()
            try:
                names = [n for k in batch for n in self.keyring.names(self.key_prefix, k)]
                values = self._get_many(names)
            except StoreError as e:
                self.breaker.failure()
                errors += 1
                log.warning("prompt cache lookup failed (treated as a miss): %s", e)
                break
            self.breaker.success()
            verified = self._verify(batch, values)
            found = [len(v) for v in values if v is not None]
            if found:  # what fetching costs: the round trip and the MAC check
                self.measured_fetch(sum(found), time.perf_counter() - t0, sum(found) / len(found))
            stop = False
            for j, k in enumerate(batch):
                p, value, key_index, bad = self._open(ns, k, len(pages), verified[j * n_keys : (j + 1) * n_keys])
                mac_failures, corrupt = mac_failures + bad[0], corrupt + bad[1]
                if p is None:
                    stop = True
                    break
                if key_index > 0:
                    rekey.append(_Write(ns, k, p, value))
                pages.append(p)
                fetched.append((k, p))
            if stop:
                break
        if self.local is not None and fetched:
            self.local.put_chain(fetched)
            self.local.get_prefix(want[:n_local])  # the head stays the most recent
        if n_local and self.store.remote:  # keep the shared copy alive while this instance serves it locally
            self._writer.submit(_Touch([self.store_key(ns, k) for k in want[:n_local]]))
        for w in rekey:
            if self._writer.submit(w):
                self.stats.add(rekeyed=1)
        self.stats.add(
            lookups=1,
            lookup_pages=len(want),
            hits=len(pages),
            local_hits=n_local,
            mac_failures=mac_failures,
            corrupt=corrupt,
            errors=errors,
            skipped=skipped,
            store_slower=slow,
        )
        self.stats.add_scope(ns.scope, len(want), len(pages))
        return CacheLookup(keys, pages, n_local, decision)

    # ---- write-back --------------------------------------------------------------------------------------
    def put(self, ns: CacheNamespace, key: bytes, payload: PagePayload) -> bool:
        """Cache a newly computed full page (asynchronously). Never blocks; False if it was dropped."""
        return self.put_many(ns, [(key, payload)]) == 1

    def put_many(
        self,
        ns: CacheNamespace,
        items: Sequence[tuple[bytes, PagePayload]],
        values: Sequence[bytes] | None = None,
        to_store: Sequence[bool] | None = None,
    ) -> int:
        """Cache newly computed full pages of one prompt, in prompt order (asynchronously; the local tier keeps
        them as one chain). `values`: their encoded values when the caller made them (`value.encode_row`);
        `to_store`: False for a page the store holds already (the local tier's alone). Never blocks; returns how
        many were accepted (the rest were dropped)."""
        encoded: Sequence[bytes | None] = values if values is not None else [None] * len(items)
        send: Sequence[bool] = to_store if to_store is not None else [True] * len(items)
        if not len(encoded) == len(send) == len(items):
            raise ValueError(f"{len(items)} pages but {len(encoded)} values and {len(send)} store flags")
        full = [(k, p, v, w) for (k, p), v, w in zip(items, encoded, send) if p.num_tokens == ns.layout.page_size]
        if self.local is not None:
            self.local.put_chain([(k, p) for k, p, _, _ in full])
        accepted = 0
        for k, p, v, w in full:  # head first; after a drop the rest would sit behind a hole: not sent
            if w and not self._writer.submit(_Write(ns, k, p, v)):
                break
            accepted += 1
        if accepted < len(full):
            self.stats.add(write_drops=len(full) - accepted)
        return accepted

    def stored(self, ns: CacheNamespace, keys: list[bytes]) -> list[bool]:
        """Which pages of `keys` (chain digests in `ns`) the store holds now, by key name under the current secret
        (their TTLs reset: a page about to be written back is in use). All False when the store cannot answer
        (breaker open, an error): the caller writes them."""
        if not keys:
            return []
        if not self.breaker.allow():
            return [False] * len(keys)
        try:
            held = self.store.touch_many([self.store_key(ns, k) for k in keys], self.ttl_ms)
        except StoreError as e:
            self.breaker.failure()
            self.stats.add(errors=1)
            log.warning("prompt cache: which pages the store holds: %s", e)
            return [False] * len(keys)
        self.breaker.success()
        self.stats.add(write_skips=sum(held))
        return held

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued writes reached the store (tests, benchmarks); False on timeout."""
        return self._writer.flush(timeout)

    def _write_batch(self, batch: list[_Write | _Touch]) -> None:
        items: list[tuple[bytes, bytes]] = []
        touch: list[bytes] = []
        too_large = bad = 0
        for it in batch:
            if isinstance(it, _Touch):
                touch += it.store_keys
                continue
            try:
                value = it.value if it.value is not None else encode_value(it.payload, it.ns, it.key)
            except InvalidRequest as e:
                bad += 1
                log.error("prompt cache: page not cacheable: %s", e)
                continue
            if len(value) > self.max_value_bytes:
                too_large += 1
                continue
            sealed = concat(self.keyring.seal(it.key, value))  # value || MAC tag, copied outside the GIL
            items.append((self.store_key(it.ns, it.key), sealed))
        self.stats.add(too_large=too_large, errors=bad)
        if not items and not touch:
            return
        if not self.breaker.allow():
            self.stats.add(write_drops=len(items), skipped=1)
            return
        try:
            self.store.set_many(items, self.ttl_ms)
            self.store.touch_many(touch, self.ttl_ms)
        except StoreError as e:
            self.breaker.failure()
            self.stats.add(errors=1, write_drops=len(items))
            log.warning("prompt cache write-back failed (%d pages dropped): %s", len(items), e)
            return
        self.breaker.success()
        self.stats.add(writes=len(items), write_bytes=sum(len(v) for _, v in items))

    def close(self, timeout: float = 5.0) -> None:
        self._writer.close(timeout)
        self._verify_pool.shutdown(wait=False)
        with self._fetch_lock:
            if self._fetch_pool is not None:
                self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        if self.fetch_process is not None:
            self.fetch_process.close()
        self.store.close()


def redact(url: str) -> str:
    """A Redis URL without its password, for logs."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def redis_is_local(url: str) -> bool:
    """True when the Redis of `url` is on this host only (a unix socket or a loopback address)."""
    if url.startswith("unix://"):
        return True
    return is_loopback(urlsplit(url).hostname or "")


def cache_keyring(opts: CacheOptions, env: Mapping[str, str], url: str) -> CacheKeyring:
    """The configured cache secrets; without any (docs/prompt_cache.md): a random one for an in-process store or a
    Redis on this host (that Redis is then private to this process: no other instance can read its pages), and a
    refusal to start (SystemExit) for a Redis elsewhere, where a writer of that Redis could otherwise forge pages."""
    keyring = keyring_from(opts.cache_secret_file, env)
    if keyring is not None:
        ids = ", ".join(k.id for k in keyring.keys)
        log.info(
            "prompt cache: values keyed with secret %s (from %s; accepted: %s)", keyring.current.id, keyring.origin, ids
        )
        return keyring
    if not url:
        return CacheKeyring.generate("a random secret: the in-process store is private anyway")
    if redis_is_local(url):
        log.warning(
            "prompt cache: NO CACHE SECRET (--cache-secret-file / $PDSERVE_CACHE_SECRET_FILE): pages in the Redis on "
            "this host are keyed with a random secret of this process, so no other instance can use them "
            "(`pdserve up` gives its stack one secret)"
        )
        return CacheKeyring.generate("a random secret of this process (no cache secret configured)")
    raise SystemExit(
        f"prompt cache: Redis {redact(url)} is not on this host and no cache secret is configured: anyone who can "
        "write that Redis could forge cached KV pages. Give every prefill instance the same --cache-secret-file "
        "(or $PDSERVE_CACHE_SECRET_FILE; `python deploy/make_certs.py DIR` writes one), or --prompt-cache false"
    )


def redis_password(opts: CacheOptions, env: Mapping[str, str]) -> str | None:
    """The Redis password of `--redis-password-file` (else $REDIS_PASSWORD_FILE), None without one."""
    path = opts.redis_password_file or env.get("REDIS_PASSWORD_FILE", "")
    if not path:
        return None
    try:
        password = Path(path).read_text().strip()
    except OSError as e:
        raise SystemExit(f"cannot read Redis password file {path}: {e}") from None
    if not password or any(c.isspace() for c in password):
        raise SystemExit(f"Redis password file {path}: one password without spaces")
    return password


def build_prompt_cache(opts: CacheOptions, environ: Mapping[str, str] | None = None) -> PromptCache | None:
    """The cache a service's options ask for: Redis (`--redis-url`, else $REDIS_URL) with a local LRU tier in
    front, or the in-process store; None when `--prompt-cache false`. Keyed with the cache secret
    (`cache_keyring`); a Redis that refuses the credentials or the TLS handshake stops the start (SystemExit)."""
    if not opts.prompt_cache:
        log.info("prompt cache: off")
        return None
    env: Mapping[str, str] = os.environ if environ is None else environ
    url = opts.redis_url or env.get("REDIS_URL", "")
    breaker = CircuitBreaker(opts.cache_breaker_failures, opts.cache_breaker_cooldown_s)
    common: dict[str, Any] = dict(
        ttl_s=opts.cache_ttl_s,
        max_value_bytes=int(opts.cache_max_value_mb * MiB),
        write_queue=opts.cache_write_queue,
        lookup_batch=opts.cache_lookup_batch,
        breaker=breaker,
        key_prefix=opts.cache_key_prefix,
        keyring=cache_keyring(opts, env, url),
        fetch_connections=opts.cache_fetch_connections,
        fetch_batch_pages=opts.cache_fetch_batch_pages,
    )
    if not url:
        log.info(
            "prompt cache: in-process, %.0f MiB (set REDIS_URL to share it across instances)", opts.cache_memory_mb
        )
        return PromptCache(MemoryStore(int(opts.cache_memory_mb * MiB)), **common)
    from pdserve.cache.redis_store import RedisStore, StoreRefused

    try:
        store = RedisStore(
            url,
            cluster=opts.redis_cluster,
            timeout_s=opts.cache_timeout_ms / 1e3,
            connect_timeout_s=opts.cache_timeout_ms / 1e3,
            password=redis_password(opts, env),
        )
    except ValueError as e:
        raise SystemExit(f"prompt cache: {e}") from None
    try:
        policy = store.eviction_policy()
    except StoreRefused as e:
        store.close()
        raise SystemExit(f"prompt cache: Redis {redact(url)}: {e}") from None
    if policy is None:
        log.warning("prompt cache: Redis %s not reachable now; serving continues as misses until it is", redact(url))
    elif not policy.startswith("allkeys-"):
        log.warning(
            "prompt cache: Redis maxmemory-policy is %s; use allkeys-lru so that pages are evicted "
            "instead of writes failing when memory is full",
            policy,
        )
    if not url.startswith(("rediss://", "unix://")) and not redis_is_local(url):
        log.warning("prompt cache: Redis %s in PLAINTEXT over the network (use rediss://)", redact(url))
    local_mb = opts.local_tier_mb()
    log.info(
        "prompt cache: Redis%s %s, ttl %.0fs, local tier %.0f MiB%s",
        " Cluster" if opts.redis_cluster else "",
        redact(url),
        opts.cache_ttl_s,
        local_mb,
        " (auto)" if local_mb != opts.cache_local_mb else "",
    )
    return PromptCache(store, local_bytes=int(local_mb * MiB), **common)
