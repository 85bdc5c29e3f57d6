"""The write-back of a prefill whose prefix fetch raced its compute, against a real redis-server: pages the fetch
never read (the compute covered them before its start) are asked for, not assumed stored; pages it verified are not
written again; the page a miss or a forged value ended it at is always written."""

from __future__ import annotations

import pytest
import torch
from cache_testutil import INT8, KEYRING, PAGE, make_page, namespace

from pdserve.cache.prefix_fetch import PrefixFetch
from pdserve.cache.prefix_policy import PrefixPlan, PrefixPolicy
from pdserve.cache.prompt_cache import CacheLookup, PromptCache
from pdserve.cache.redis_store import RedisStore
from pdserve.kv.transfer import ExportedPages
from pdserve.kv.transfer.page_format import PageFormat

N = 10  # full pages of the prompt
CHUNK = 4  # the engine's chunk in pages: a fetch with no rates measured starts after it


def setup(url: str, local_bytes: int = 0):
    cache = PromptCache(RedisStore(url), keyring=KEYRING, fetch_batch_pages=2, local_bytes=local_bytes)
    ns = namespace(INT8)
    tokens = list(range(7, 7 + N * PAGE + 1))
    pages = [make_page(INT8, i) for i in range(N)]
    return cache, ns, tokens, ns.page_keys(tokens), pages


def store_all(cache: PromptCache, ns, keys, pages, skip: tuple[int, ...] = ()) -> None:
    writer = PromptCache(cache.store, keyring=KEYRING)  # another instance (no local tier) wrote the prefix
    writer.put_many(ns, [(k, p) for i, (k, p) in enumerate(zip(keys, pages)) if i not in skip])
    assert writer.flush()


def race_and_write_back(cache: PromptCache, ns, keys, pages) -> PrefixPlan:
    """A prefill's prefix plan: the fetch over every page from the store, started after the first chunk (no rates
    measured), run to its end; then the write-back of every page, as the engine exports them (compute + fetch)."""
    plan = PrefixPlan(N, hit=CacheLookup(keys, []))
    plan.fetch = PrefixFetch(cache, ns, keys, 0, N, batch_pages=2, chunk_pages=CHUNK).start()
    assert plan.fetch.start_page == CHUNK
    plan.fetch.wait(N, 10)
    assert plan.fetch.finished
    if cache.local is not None:  # the fetch threads copied nothing into it: the write-back gives it its pages
        assert cache.local.get_prefix(keys[CHUNK:]) == []
    rows = PageFormat(INT8).rows_from_payloads(pages)
    batches = [ExportedPages(list(range(N)), [PAGE] * N, rows)]
    PrefixPolicy(cache, PAGE, pool_reuse=False).write_back(ns, plan, 0, batches, INT8)
    assert cache.flush()
    return plan


def stored_chain(cache: PromptCache, ns, tokens) -> int:
    """Pages of the prompt's chain a fresh instance finds in the store, from the start."""
    reader = PromptCache(cache.store, keyring=KEYRING)
    return reader.lookup(ns, tokens, max_pages=N).num_pages


def test_a_new_prompt_is_written_whole_the_pages_before_the_fetch_included(redis):
    cache, ns, tokens, keys, pages = setup(redis.url)
    race_and_write_back(cache, ns, keys, pages)  # the fetch misses at page CHUNK: the store has none
    assert cache.stats.writes == N and cache.stats.write_skips == 0
    assert stored_chain(cache, ns, tokens) == N  # pages 0..CHUNK-1, never read by the fetch, are there too
    cache.close()


@pytest.mark.parametrize("local", [False, True], ids=["store-only", "local-tier"])
def test_pages_the_store_holds_are_not_written_again(redis, local):
    cache, ns, tokens, keys, pages = setup(redis.url, local_bytes=64 << 20 if local else 0)
    store_all(cache, ns, keys, pages)
    client = redis.client()
    for i in range(CHUNK):
        client.pexpire(cache.store_key(ns, keys[i]), 5_000)
    plan = race_and_write_back(cache, ns, keys, pages)
    assert plan.fetch.verified_pages() == (set(range(CHUNK, N)), None)
    assert cache.stats.writes == 0 and cache.stats.write_skips == CHUNK  # asked: all there, none written
    assert all(client.pttl(cache.store_key(ns, keys[i])) > 60_000 for i in range(CHUNK))  # the ask kept them
    if local:  # the local tier keeps the computed pages the store had, and the fetch's, from the shipped rows
        got = cache.local.get_prefix(keys)
        assert len(got) == N and all(torch.equal(p.data, want.data) for p, want in zip(got, pages))
    cache.close()


def test_a_page_missing_before_the_fetch_is_the_only_one_written(redis):
    cache, ns, tokens, keys, pages = setup(redis.url)
    store_all(cache, ns, keys, pages, skip=(1,))
    assert stored_chain(cache, ns, tokens) == 1
    race_and_write_back(cache, ns, keys, pages)
    assert cache.stats.writes == 1 and cache.stats.write_skips == CHUNK - 1
    assert stored_chain(cache, ns, tokens) == N
    cache.close()


def test_the_page_a_forged_value_ended_the_fetch_at_is_written_again(redis):
    cache, ns, tokens, keys, pages = setup(redis.url)
    store_all(cache, ns, keys, pages)
    client = redis.client()
    name = cache.store_key(ns, keys[6])
    value = client.get(name)
    client.set(name, value[:-1] + bytes([value[-1] ^ 1]))  # a forged tag: the fetch ends there
    plan = race_and_write_back(cache, ns, keys, pages)
    assert plan.fetch.verified_pages() == ({4, 5}, 6) and cache.stats.mac_failures == 1
    assert cache.stats.writes == 1  # page 6; pages 0-3 and 7-9 asked and found (pages 4-5 verified)
    assert cache.stats.write_skips == N - 3
    assert stored_chain(cache, ns, tokens) == N
    cache.close()
