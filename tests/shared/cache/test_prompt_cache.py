"""PromptCache against real Redis: prefix hits, TTL, eviction, corruption, outages, local tier, write-back."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from cache_testutil import INT8, KEYRING, PAGE, make_page, namespace

from pdserve.cache.breaker import CircuitBreaker
from pdserve.cache.config import CacheOptions
from pdserve.cache.prompt_cache import PromptCache, build_prompt_cache
from pdserve.cache.redis_store import RedisStore
from pdserve.cache.store import MemoryStore
from pdserve.cache.value import encode_value
from pdserve.testing.wait import wait_until

NS = namespace()


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_cache(url: str, **kw) -> PromptCache:
    kw.setdefault("breaker", CircuitBreaker(failures=2, cooldown_s=0.3))
    kw.setdefault("keyring", KEYRING)
    return PromptCache(RedisStore(url, timeout_s=kw.pop("timeout_s", 1.0)), **kw)


def fill(cache: PromptCache, prompt: list[int], ns=NS, seed: int = 0) -> list:
    """Write every full page of `prompt` (what a prefill does after computing them); returns the pages."""
    keys = ns.page_keys(prompt)
    pages = [make_page(ns.layout, i, seed) for i in range(len(keys))]
    for k, p in zip(keys, pages):
        assert cache.put(ns, k, p)
    assert cache.flush(10)
    return pages


@pytest.fixture
def cache(redis):
    c = make_cache(redis.url)
    yield c
    c.close()


def test_partial_prefix_hits_at_page_boundaries(cache):
    base = tokens(4 * PAGE, seed=1)
    pages = fill(cache, base)
    assert cache.stats.writes == 4
    for n, max_pages, want in [
        (4 * PAGE, 4, 4),
        (4 * PAGE, 3, 3),
        (4 * PAGE + 1, 4, 4),
        (4 * PAGE + 9, 9, 4),
        (3 * PAGE + 2, 9, 3),
        (PAGE - 1, 9, 0),
        (4 * PAGE, 0, 0),
    ]:
        prompt = (base + tokens(20, seed=2))[:n]
        hit = cache.lookup(NS, prompt, max_pages)
        assert hit.num_pages == want, (n, max_pages)
        assert len(hit.keys) == n // PAGE
        for got, ref in zip(hit.pages, pages):
            assert torch.equal(got.data, ref.data) and torch.equal(got.scales, ref.scales)
    diverged = base[: 2 * PAGE + 1] + [(base[2 * PAGE + 1] + 1) % 500] + base[2 * PAGE + 2 :]
    assert cache.lookup(NS, diverged, 4).num_pages == 2  # a different token in page 2 ends the prefix there
    other = namespace(dataclasses.replace(INT8, group_size=8))
    assert cache.lookup(other, base, 4).num_pages == 0  # another KV format never sees these pages
    s = cache.stats.snapshot()
    assert s["corrupt"] == 0 and s["errors"] == 0 and s["hits"] + s["misses"] == s["lookup_pages"]


def test_ttl_expiry_and_refresh_on_hit(redis):
    """Refresh is read from Redis' PTTL (no timing margins); expiry is waited for without touching the keys."""
    r = redis.client()
    cache = make_cache(redis.url, ttl_s=600)
    hot, cold = tokens(2 * PAGE, seed=3), tokens(2 * PAGE, seed=4)
    fill(cache, hot)
    fill(cache, cold)
    hot_keys = [cache.store_key(NS, k) for k in NS.page_keys(hot)]
    cold_keys = [cache.store_key(NS, k) for k in NS.page_keys(cold)]
    assert all(590_000 < r.pttl(k) <= 600_000 for k in hot_keys + cold_keys)
    for k in hot_keys + cold_keys:
        r.pexpire(k, 5_000)
    assert cache.lookup(NS, hot, 2).num_pages == 2  # each hit resets the TTL of the pages it returned ...
    assert all(r.pttl(k) > 590_000 for k in hot_keys)
    assert all(0 < r.pttl(k) <= 5_000 for k in cold_keys)  # ... and only theirs
    for k in cold_keys:
        r.pexpire(k, 50)
    wait_until(lambda: r.exists(*cold_keys) == 0, timeout=10, what="cold pages expired")
    assert cache.lookup(NS, cold, 2).num_pages == 0
    assert cache.lookup(NS, hot, 2).num_pages == 2
    cache.close()
    short = make_cache(redis.url, ttl_s=0.05)  # the cache's own TTL expires pages too
    fill(short, cold, seed=1)
    wait_until(lambda: r.exists(*cold_keys) == 0, timeout=10, what="pages written with a 50 ms TTL expired")
    assert short.lookup(NS, cold, 2).num_pages == 0
    short.close()


def test_eviction_under_allkeys_lru(start_redis):
    """Pages of 16 KiB into a 2 MiB Redis: old prompts get evicted, lookups stay consistent prefixes."""
    srv = start_redis("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")
    layout = dataclasses.replace(INT8, page_size=16, num_layers=4, head_dim=64, group_size=64)
    ns = namespace(layout)
    # about Redis' eviction, not the breaker: two slow answers under load (1 s timeout) would open a 2-failure
    # breaker and turn every later lookup into a miss; the stats are checked (and shown) before the hits
    breaker = CircuitBreaker(failures=1000, cooldown_s=0.3)
    cache = make_cache(srv.url, write_queue=4096, timeout_s=5.0, breaker=breaker)
    prompts = [tokens(8 * 16, seed=100 + i) for i in range(40)]  # 320 pages, ~5.5 MiB of values
    for i, p in enumerate(prompts):
        fill(cache, p, ns, seed=i)
    assert cache.stats.write_drops == 0 and cache.stats.errors == 0
    assert srv.client().info("stats")["evicted_keys"] > 0
    hits = []
    for i, p in enumerate(prompts):
        hit = cache.lookup(ns, p, 8)
        hits.append(hit.num_pages)
        for j, got in enumerate(hit.pages):  # whatever survives is exactly what was written
            assert torch.equal(got.data, make_page(layout, j, seed=i).data)
    assert cache.stats.corrupt == 0 and cache.stats.errors == 0, cache.stats
    assert sum(hits) < 8 * len(prompts)  # pages were lost ...
    assert sum(hits[-10:]) > sum(hits[:10]), hits  # ... mostly old ones (Redis' LRU is approximate)
    cache.close()


def test_corrupt_values_are_counted_misses_and_get_replaced(redis):
    cache = make_cache(redis.url)
    prompt = tokens(4 * PAGE, seed=5)
    pages = fill(cache, prompt)
    keys = NS.page_keys(prompt)
    r = redis.client()
    victim = cache.store_key(NS, keys[2])
    good = r.get(victim)
    damaged = [
        good[:-1] + bytes([good[-1] ^ 1]),
        good[: len(good) // 2],
        b"",
        b"garbage",
        bytes(good[:200]) + bytes(len(good) - 200),  # zeroed tail
        r.get(cache.store_key(NS, keys[3])),  # the stored value of another page
    ]
    for n, bad in enumerate(damaged, 1):  # damage fails the MAC before anything is parsed
        r.set(victim, bad)
        assert cache.lookup(NS, prompt, 4).num_pages == 2
        assert (cache.mac_failures, cache.corrupt) == (n, 0)
    # signed with the deployment's secret but holding another page (a writer's bug): the MAC passes, parsing fails
    r.set(victim, b"".join(KEYRING.seal(keys[2], encode_value(pages[3], NS, keys[3]))))
    assert cache.lookup(NS, prompt, 4).num_pages == 2
    assert (cache.mac_failures, cache.corrupt) == (len(damaged), 1)
    fill(cache, prompt)  # the page is recomputed and written again
    assert cache.lookup(NS, prompt, 4).num_pages == 4
    assert r.get(victim) == good


def test_redis_killed_and_restarted_under_load(start_redis):
    srv = start_redis()
    cache = make_cache(srv.url, timeout_s=0.2, breaker=CircuitBreaker(failures=2, cooldown_s=0.3))
    prompts = [tokens(6 * PAGE, seed=200 + i) for i in range(4)]
    for p in prompts:
        fill(cache, p)
    stop = threading.Event()
    slowest, failures, results = [0.0], [], []

    def worker(i: int) -> None:
        j = 0
        while not stop.is_set():
            p = prompts[(i + j) % len(prompts)]
            t0 = time.monotonic()
            try:
                hit = cache.lookup(NS, p, 6)
                for k, pg in zip(hit.keys[hit.num_pages :], range(hit.num_pages, 6)):  # "recompute" the rest
                    cache.put(NS, k, make_page(INT8, pg))
                results.append(hit.num_pages)
            except Exception as e:
                failures.append(e)
            slowest[0] = max(slowest[0], time.monotonic() - t0)
            j += 1
            time.sleep(0.002)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(results) >= 20, timeout=60, what="lookups under load")
    srv.kill()
    wait_until(
        lambda: cache.breaker.times_opened > 0 and cache.stats.skipped > 0,
        timeout=60,
        what="the breaker opened and kept Redis out of the way",
    )
    down_errors = cache.errors
    srv.restart()
    n_restart = len(results)
    # recovers by itself: pages are written again, then lookups hit
    wait_until(lambda: 6 in results[n_restart:], timeout=60, what="full hits after the restart")
    stop.set()
    for t in threads:
        t.join(10)
    assert not failures
    assert down_errors > 0 and cache.stats.skipped > 0  # errors, then the breaker kept Redis out of the way
    assert 6 in results[n_restart:]  # full hits again, under load
    assert slowest[0] < 10  # no lookup hung (a bound for a hang, not a latency figure: timeouts are 0.2 s)
    assert cache.flush(10)
    for p in prompts:
        fill(cache, p)
        assert cache.lookup(NS, p, 6).num_pages == 6
    cache.close()


def test_slow_redis_times_out_as_miss(redis):
    cache = make_cache(redis.url, timeout_s=0.15)
    prompt = tokens(3 * PAGE, seed=6)
    fill(cache, prompt)
    r = redis.client()
    r.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")  # GETEX writes (the TTL); UNPAUSE still runs
    t0 = time.monotonic()
    assert cache.lookup(NS, prompt, 3).num_pages == 0
    assert time.monotonic() - t0 < 15 and cache.errors == 1  # a miss long before the pause would have ended
    r.execute_command("CLIENT", "UNPAUSE")
    assert cache.lookup(NS, prompt, 3).num_pages == 3
    cache.close()


def test_local_tier_in_front_of_redis(redis):
    """Two instances share pages through Redis; each one's local tier then serves its repeats."""
    a = make_cache(redis.url, local_bytes=1 << 20)
    b = make_cache(redis.url, local_bytes=1 << 20, ttl_s=5.0)
    prompt = tokens(5 * PAGE, seed=7)
    fill(a, prompt)
    hit = b.lookup(NS, prompt, 5)
    assert (hit.num_pages, hit.local_hits) == (5, 0)
    hit = b.lookup(NS, prompt, 5)
    assert (hit.num_pages, hit.local_hits) == (5, 5)
    assert b.local_hit_ratio() == pytest.approx(0.5) and b.hit_ratio() == 1.0
    r = redis.client()
    key = b.store_key(NS, hit.keys[0])
    r.pexpire(key, 1000)
    b.lookup(NS, prompt, 5)  # local hits refresh the shared copy's TTL (asynchronously)
    assert b.flush(5) and r.pttl(key) > 2000
    a_hit = a.lookup(NS, prompt + tokens(PAGE, 8), 6)  # the writer's own tier has them too
    assert (a_hit.num_pages, a_hit.local_hits) == (5, 5)
    r.flushall()
    assert b.lookup(NS, prompt, 5).num_pages == 5  # the local tier outlives Redis' copy
    a.close()
    b.close()


def test_full_write_queue_drops_and_counts(redis):
    cache = make_cache(redis.url, write_queue=2, timeout_s=3.0)
    prompt = tokens(20 * PAGE, seed=9)
    keys = NS.page_keys(prompt)
    pages = [make_page(INT8, i) for i in range(len(keys))]
    redis.client().execute_command("CLIENT", "PAUSE", 2000, "WRITE")  # the writer's SETs block for 2 s
    t0 = time.monotonic()
    accepted = [cache.put(NS, k, page) for k, page in zip(keys, pages)]
    assert time.monotonic() - t0 < 1.0  # put() never waits for Redis (one blocked SET would take 2 s)
    assert cache.flush(10)
    assert cache.write_drops == accepted.count(False) >= 16
    assert cache.stats.writes == accepted.count(True)


def test_oversized_and_partial_pages_not_written(redis):
    cache = make_cache(redis.url, max_value_bytes=100)
    prompt = tokens(2 * PAGE, seed=10)
    fill(cache, prompt)
    assert cache.stats.too_large == 2 and redis.client().dbsize() == 0
    partial = dataclasses.replace(make_page(INT8, 0), num_tokens=PAGE - 1)
    assert not cache.put(NS, NS.page_keys(prompt)[0], partial)


def test_build_prompt_cache_from_options(redis):
    embedded = build_prompt_cache(CacheOptions(), environ={})
    assert isinstance(embedded.store, MemoryStore) and embedded.local is None
    prompt = tokens(3 * PAGE, seed=11)
    fill(embedded, prompt)
    assert embedded.lookup(NS, prompt, 3).num_pages == 3
    embedded.close()
    from_env = build_prompt_cache(CacheOptions(cache_local_mb=1), environ={"REDIS_URL": redis.url})
    assert isinstance(from_env.store, RedisStore) and from_env.store.url == redis.url and from_env.local is not None
    from_env.close()
    flag = build_prompt_cache(CacheOptions(redis_url=redis.url), environ={"REDIS_URL": "redis://nowhere:1"})
    assert flag.store.url == redis.url
    flag.close()
    assert build_prompt_cache(CacheOptions(prompt_cache=False)) is None
    with pytest.raises(SystemExit):
        CacheOptions(redis_url="http://x").validate_cache()


def test_pages_are_counted_per_scope_and_scopes_are_bounded():
    """Each lookup's pages are counted under its namespace's scope (the router's tenant / shared group), so an
    operator sees which tenant's prompts hit; past MAX_SCOPES distinct scopes the rest share one label."""
    from pdserve.cache import stats as cache_stats

    cache = PromptCache(MemoryStore(1 << 22))
    try:
        alice, bob = dataclasses.replace(NS, scope="tenant:alice"), dataclasses.replace(NS, scope="tenant:bob")
        prompt = tokens(3 * PAGE + 1, seed=4)
        fill(cache, prompt, alice)
        assert cache.lookup(alice, prompt, 3).num_pages == 3
        assert cache.lookup(bob, prompt, 3).num_pages == 0  # another tenant's scope never sees alice's pages
        assert cache.stats.scopes() == {"tenant:alice": (3, 3), "tenant:bob": (3, 0)}
        for i in range(cache_stats.MAX_SCOPES):
            cache.stats.add_scope(f"tenant:t{i}", 1, 0)
        scopes = cache.stats.scopes()
        assert len(scopes) == cache_stats.MAX_SCOPES + 1 and scopes[cache_stats.OTHER_SCOPE] == (2, 0)
    finally:
        cache.close()


def test_fetch_batch_pages_option_reaches_the_fetches(redis):
    """--cache-fetch-batch-pages sizes each racing-fetch request; out of 1..MAX it is refused at start-up."""
    from pdserve.cache.config import MAX_FETCH_BATCH_PAGES

    cache = build_prompt_cache(CacheOptions(redis_url=redis.url, cache_fetch_batch_pages=16), environ={})
    assert cache.fetch_batch_pages == 16
    cache.close()
    for bad in (0, MAX_FETCH_BATCH_PAGES + 1):
        with pytest.raises(SystemExit, match="--cache-fetch-batch-pages"):
            CacheOptions(cache_fetch_batch_pages=bad).validate_cache()
    CacheOptions(cache_fetch_batch_pages=MAX_FETCH_BATCH_PAGES).validate_cache()
