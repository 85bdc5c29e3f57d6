"""LocalTier: bounded by bytes, and a chain is evicted from its tail (a prefix without its page 0 is useless)."""

from __future__ import annotations

import pytest
from cache_testutil import INT8, make_page, namespace

from pdserve.cache.config import AUTO_LOCAL_MAX_MB, AUTO_LOCAL_MIN_MB, CacheOptions, MiB
from pdserve.cache.local_tier import LocalTier
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.store import MemoryStore

PAGE_BYTES = make_page(INT8, 0).nbytes


def chain(n: int, seed: int) -> list[tuple[bytes, object]]:
    return [(bytes([seed, i]), make_page(INT8, i, seed)) for i in range(n)]


def test_put_chain_evicts_the_oldest_chain_from_its_tail():
    tier = LocalTier(10 * PAGE_BYTES)
    a, b = chain(8, 1), chain(4, 2)
    tier.put_chain(a)
    tier.put_chain(b)  # 12 pages for 10 slots: two of a's go, its last two
    assert tier.used_bytes == 10 * PAGE_BYTES
    assert len(tier.get_prefix([k for k, _ in a])) == 6
    assert [k for k, _ in a[6:]] == [k for k, _ in a[6:] if k not in tier]
    assert len(tier.get_prefix([k for k, _ in b])) == 4


def test_a_chain_written_past_capacity_keeps_its_head():
    """Writing one prompt larger than the tier keeps its first pages (what the next lookup of it can use); the old
    behaviour, inserting in prompt order, kept only the tail and so never hit again."""
    tier = LocalTier(5 * PAGE_BYTES)
    a = chain(8, 1)
    tier.put_chain(a)
    assert len(tier.get_prefix([k for k, _ in a])) == 5


def test_get_prefix_refreshes_tail_first_so_a_hit_chain_survives():
    tier = LocalTier(8 * PAGE_BYTES)
    a, b, c = chain(4, 1), chain(4, 2), chain(3, 3)
    tier.put_chain(a)
    tier.put_chain(b)
    assert len(tier.get_prefix([k for k, _ in a])) == 4  # a is now the most recent, head first
    tier.put_chain(c)  # 3 pages must go: b's tail first
    assert len(tier.get_prefix([k for k, _ in a])) == 4
    assert len(tier.get_prefix([k for k, _ in b])) == 1
    # a lookup that stops at a missing page returns the run before it
    assert tier.get_prefix([a[0][0], b"missing", a[2][0]]) == [a[0][1]]


def test_oversized_page_is_not_cached_and_replacing_a_key_keeps_the_byte_count():
    tier = LocalTier(PAGE_BYTES)
    (k, p), (k2, p2) = chain(2, 1)
    tier.put(k, p)
    tier.put(k, p)
    assert (len(tier), tier.used_bytes) == (1, PAGE_BYTES)
    tier.put(k2, p2)
    assert k not in tier and k2 in tier
    tiny = LocalTier(PAGE_BYTES - 1)
    tiny.put(k, p)
    assert len(tiny) == 0


def test_prompt_cache_write_back_of_a_long_prompt_hits_its_prefix_next_time():
    """The served pattern that used to miss: a prompt of more pages than the tier holds, then the same prefix."""
    ns = namespace()
    cache = PromptCache(MemoryStore(1 << 20), local_bytes=6 * PAGE_BYTES)
    cache.store.remote = True  # as Redis: the local tier answers first; the store here is too small to matter
    prompt = list(range(100, 100 + 8 * INT8.page_size))
    keys = ns.page_keys(prompt)
    assert cache.put_many(ns, [(k, make_page(INT8, i)) for i, k in enumerate(keys)]) == 8
    hit = cache.lookup(ns, prompt, max_pages=8)
    assert hit.local_hits >= 6
    cache.close()


@pytest.mark.parametrize(
    ("available", "want_mb"),
    [(1 << 30, AUTO_LOCAL_MIN_MB), (80 << 30, 10 * 1024.0), (1 << 40, AUTO_LOCAL_MAX_MB)],
)
def test_auto_local_tier_size(available, want_mb):
    assert CacheOptions().local_tier_mb(available) == want_mb
    assert CacheOptions(cache_local_mb=0).local_tier_mb(available) == 0
    assert CacheOptions(cache_local_mb=300).local_tier_mb(available) == 300


def test_auto_local_tier_size_on_this_host_is_a_share_of_it():
    mb = CacheOptions().local_tier_mb()
    assert AUTO_LOCAL_MIN_MB <= mb <= AUTO_LOCAL_MAX_MB
    assert mb * MiB > 0


@pytest.mark.parametrize("bad", [-2.0, -0.5])
def test_negative_local_tier_other_than_auto_is_refused(bad):
    with pytest.raises(SystemExit, match="cache-local-mb"):
        CacheOptions(cache_local_mb=bad).validate_cache()
    CacheOptions(cache_local_mb=-1).validate_cache()
