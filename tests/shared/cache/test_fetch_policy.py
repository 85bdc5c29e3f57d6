"""Store fetch vs recompute: the pure decision, and PromptCache applying it per lookup (the local tier always
serves; the store only when it measured faster than prefill)."""

import time

import pytest
from cache_testutil import INT8, KEYRING, PAGE, make_page, namespace

from pdserve.cache.fetch_policy import decide_fetch
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.store import MemoryStore

KB68 = 68 * 1024  # an 8B model's int8 page of one token is ~68 KB: a 16-token page ~1.1 MB


def test_decision_compares_tokens_per_second():
    page = 16 * KB68
    # Redis at 1 GB/s delivers 8B int8 KV at 1e9 / 1.1 MB per 16-token page × 16 ≈ 14k tokens/s
    d = decide_fetch(1e9, page, 16, 40_000.0)  # an H200 computes 40k tokens/s: recompute
    assert not d.fetch and d.reason == "slower" and d.fetch_tokens_per_s == pytest.approx(1e9 / page * 16)
    d = decide_fetch(1e9, page, 16, 2_000.0)  # a slow engine: fetch
    assert d.fetch and d.reason == "faster"
    for args in ((None, page, 16, 40_000.0), (1e9, None, 16, 40_000.0), (1e9, page, 16, None), (0.0, page, 16, 1.0)):
        d = decide_fetch(*args)
        assert d.fetch and d.reason == "unmeasured"
    assert decide_fetch(1e9, page, 16, 40_000.0).attributes()["pdserve.cache.store_fetch"] is False


class SlowRemoteStore(MemoryStore):
    """A remote-looking store that takes `delay_s` per fetch (a slow network)."""

    remote = True

    def __init__(self, delay_s: float):
        super().__init__(64 << 20)
        self.delay_s = delay_s
        self.fetches = 0

    def get_many(self, keys, ttl_ms):
        self.fetches += 1
        time.sleep(self.delay_s)
        return super().get_many(keys, ttl_ms)

    def touch_many(self, keys, ttl_ms):  # which exist, without the reads this store gates or slows
        with self._lock:
            return [k in self._items for k in keys]


def test_slow_store_is_skipped_once_measured_local_tier_still_serves():
    ns = namespace(INT8)
    tokens = list(range(8 * PAGE + 1))
    writer = PromptCache(SlowRemoteStore(0.0), keyring=KEYRING)
    store = writer.store
    for i, k in enumerate(ns.page_keys(tokens)):  # another instance wrote 8 pages
        writer.put(ns, k, make_page(INT8, i))
    assert writer.flush()
    store.delay_s = 0.05  # 8 pages of ~400 bytes in 50 ms: ~64 KB/s, ~640 tokens/s
    reader = PromptCache(store, local_bytes=1 << 20, lookup_batch=4, keyring=KEYRING)
    first = reader.lookup(ns, tokens[: 4 * PAGE + 1], 4, prefill_tokens_per_s=1e6)  # unmeasured: fetch
    assert first.num_pages == 4 and first.decision.reason == "unmeasured" and store.fetches == 1
    second = reader.lookup(ns, tokens, 8, prefill_tokens_per_s=1e6)  # store measured slower than prefill
    assert second.num_pages == 4 and second.local_hits == 4 and store.fetches == 1  # local tier only
    assert second.decision.reason == "slower" and reader.stats.store_slower == 1
    third = reader.lookup(ns, tokens, 8, prefill_tokens_per_s=100.0)  # a slower engine: the store pays again
    assert third.num_pages == 8 and third.decision.fetch and store.fetches == 2
    assert reader.lookup(ns, tokens, 8, prefill_tokens_per_s=1e6).decision is None  # all local: nothing to decide
