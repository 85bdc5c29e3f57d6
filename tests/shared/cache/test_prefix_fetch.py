"""The background prefix fetch against a real redis-server: GETEX values read straight into caller buffers
(resp_fetch), PrefixFetch landing pages in order with every check kept, and the racing lookup that keeps using the
store however its rate was measured."""

from __future__ import annotations

import time

import pytest
import redis.cluster
import torch
from cache_testutil import DENSE, INT8, KEYRING, PAGE, make_page, namespace

from pdserve.cache.fetch_policy import PROBE_AFTER_S, decide_fetch
from pdserve.cache.prefix_fetch import PrefixFetch
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.redis_store import RedisStore
from pdserve.cache.store import StoreError
from pdserve.cache.value import encode_value
from pdserve.cache.value_auth import CacheKeyring

N_PAGES = 10
HELPER = pytest.mark.parametrize("helper", [False, True], ids=["in-process", "helper"])


def closed_clean(fetch: PrefixFetch, cache: PromptCache, helper: bool) -> None:
    """Close both; with the helper, the fetch read into the shared arena and gave its block back."""
    if helper:
        assert fetch._block is not None
    fetch.close()
    if helper:  # a batch still reading when the fetch ended gives the block back when it is done
        deadline = time.monotonic() + 10
        while fetch._block is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        arena = cache.fetch_process.arena
        assert fetch._block is None and arena.free_bytes == arena.nbytes
    cache.close()


def filled(
    url: str,
    layout=INT8,
    keyring=KEYRING,
    n: int = N_PAGES,
    cluster: bool = False,
    helper: bool = False,
    local_bytes: int = 0,
) -> tuple[PromptCache, object, list[int]]:
    """A cache whose store holds `n` pages of a prompt; `helper`: its fetches run in the helper process."""
    store = RedisStore(url, cluster=cluster, timeout_s=5.0)
    cache = PromptCache(store, keyring=keyring, fetch_connections=3, fetch_batch_pages=3, local_bytes=local_bytes)
    if helper:
        assert cache.use_fetch_process(1 << 22, pin=False)
    ns = namespace(layout)
    tokens = list(range(n * PAGE + 1))
    cache.put_many(ns, [(k, make_page(layout, i)) for i, k in enumerate(ns.page_keys(tokens))])
    assert cache.flush()
    return cache, ns, tokens


def test_getex_into_reads_values_into_the_given_buffers(redis):
    store = RedisStore(redis.url)
    client = redis.client()
    client.set(b"a", b"x" * 100_000)
    client.set(b"b", b"")
    client.set(b"big", b"y" * 5000)
    bufs: dict[int, bytearray] = {}

    def dest(i, n):
        bufs[i] = bytearray(n)
        return memoryview(bufs[i])

    got = store.get_many_into([b"a", b"missing", b"b", b"big", b"a"], 60_000, dest, max_value_bytes=4096 * 25)
    assert got == [100_000, None, 0, 5000, 100_000]
    assert bytes(bufs[0]) == b"x" * 100_000 and bytes(bufs[3]) == b"y" * 5000 and bytes(bufs[4]) == bytes(bufs[0])
    assert client.pttl(b"a") > 0  # GETEX refreshed the TTL
    small = store.get_many_into([b"a", b"big"], 60_000, dest, max_value_bytes=4096)  # too large: read, dropped
    assert small == [None, None]
    client.rpush(b"list", b"v")
    with pytest.raises(StoreError, match="WRONGTYPE"):
        store.get_many_into([b"a", b"list"], 60_000, dest, 1 << 20)
    assert store.get_many_into([b"big"], 60_000, dest, 1 << 20) == [5000]  # the connection was replaced
    store.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdserve.testing.redis_cluster import RedisClusterServers

    servers = RedisClusterServers(tmp_path_factory.mktemp("cluster"), shards=3).start()
    yield servers
    servers.stop()


def test_cluster_getex_into_reads_each_key_from_its_shard(cluster):
    """Keys over every shard: each group read on its node's connection straight into the buffers, in key order;
    an error reply fails the call, and the next call works on a rebuilt client."""
    store = RedisStore(cluster.url, cluster=True, timeout_s=5.0)
    items = [(f"pdserve:kv:c{i}".encode(), bytes([i]) * (1000 + i)) for i in range(30)]
    store.set_many(items, 60_000)
    assert all(n.client().dbsize() > 0 for n in cluster.nodes)  # the keys really are spread over the shards
    bufs: dict[int, bytearray] = {}

    def dest(i, n):
        bufs[i] = bytearray(n)
        return memoryview(bufs[i])

    keys = [k for k, _ in items[::-1]] + [b"pdserve:kv:absent"]
    got = store.get_many_into(keys, 60_000, dest, max_value_bytes=1 << 20)
    assert got == [len(v) for _, v in items[::-1]] + [None]
    assert [bytes(bufs[i]) for i in range(len(items))] == [v for _, v in items[::-1]]
    redis.cluster.RedisCluster.from_url(cluster.url).rpush(b"pdserve:list", b"v")
    with pytest.raises(StoreError):
        store.get_many_into([b"pdserve:list", keys[0]], 60_000, dest, 1 << 20)
    assert store.get_many_into(keys[:3], 60_000, dest, 1 << 20) == got[:3]
    store.close()


def test_cluster_getex_into_failure_leaves_no_unread_replies(cluster):
    """Every node's commands go out before any reply is read: a call that fails while reading one node's replies
    hands the other nodes' connections back closed, not with their replies still unread (redis-py would notice
    such a connection on its next use only if the reply had arrived by then); the next calls read right."""
    store = RedisStore(cluster.url, cluster=True, timeout_s=5.0)
    client = redis.cluster.RedisCluster.from_url(cluster.url)
    keys = [f"pdserve:kv:u{i}".encode() for i in range(40)]
    store.set_many([(k, k * 50) for k in keys], 60_000)
    first = keys[0]
    other = next(k for k in keys if client.get_node_from_key(k).name != client.get_node_from_key(first).name)
    sent: list[int] = []

    def dest(i, n):  # a buffer of the wrong size for the first value: the read fails with the other node unread
        sent.append(i)
        return memoryview(bytearray(n - 1 if i == 0 else n))

    with pytest.raises(StoreError, match="dest gave"):
        store.get_many_into([first, other], 60_000, dest, 1 << 20)
    assert sent == [0]  # the other node's reply was never read
    node = store._client.get_node_from_key(other)  # the same client (a bad buffer is not a broken link)
    pool = store._client.get_redis_connection(node).connection_pool
    assert pool._available_connections and all(c._sock is None for c in pool._available_connections)
    bufs: dict[int, bytearray] = {}

    def into(i, n):
        bufs[i] = bytearray(n)
        return memoryview(bufs[i])

    for _ in range(3):  # every pooled connection of that node, had one been handed back with a reply in it
        assert store.get_many_into([other, first], 60_000, into, 1 << 20) == [len(other) * 50, len(first) * 50]
        assert bytes(bufs[0]) == other * 50 and bytes(bufs[1]) == first * 50
    store.close()
    client.close()


@HELPER
def test_cluster_fetch_lands_every_page_verified(cluster, helper):
    cache, ns, tokens = filled(cluster.url, cluster=True, helper=helper)
    keys = ns.page_keys(tokens)
    fetch = PrefixFetch(cache, ns, keys, 0, N_PAGES, batch_pages=3).start()
    assert fetch.wait(N_PAGES, 10) == N_PAGES and fetch.finished
    landed = fetch.take(0, N_PAGES)
    assert [p.page_index for p in landed.payloads] == list(range(N_PAGES))
    for p in landed.payloads:
        want = make_page(INT8, p.page_index)
        assert torch.equal(p.data, want.data) and torch.equal(p.scales, want.scales)
    assert cache.stats.hits == N_PAGES
    closed_clean(fetch, cache, helper)


@HELPER
@pytest.mark.parametrize("layout", [INT8, DENSE])
def test_fetch_lands_every_page_verified(redis, layout, helper):
    cache, ns, tokens = filled(redis.url, layout, helper=helper)
    keys = ns.page_keys(tokens)
    fetch = PrefixFetch(cache, ns, keys, 2, N_PAGES, batch_pages=3, local_pages=2).start()
    assert fetch.wait(N_PAGES, 10) == N_PAGES and fetch.finished
    landed = fetch.take(2, N_PAGES)
    assert [p.page_index for p in landed.payloads] == list(range(2, N_PAGES)) and landed.upload is None
    for p in landed.payloads:
        want = make_page(layout, p.page_index)
        assert torch.equal(p.data, want.data)
        assert (p.scales is None) == (want.scales is None)
        if p.scales is not None:
            assert torch.equal(p.scales, want.scales)
    stacked = fetch._device_pages(fetch._host, 3, 7)  # what CUDA takes from its device arena: the same bytes
    assert torch.equal(stacked.data, torch.stack([p.data for p in landed.payloads[1:5]]))
    if layout.quantized:
        assert torch.equal(stacked.scales, torch.stack([p.scales for p in landed.payloads[1:5]]))
    s = cache.stats
    assert (s.lookups, s.lookup_pages, s.hits, s.local_hits) == (1, N_PAGES, N_PAGES, 2)
    assert cache.fetch_rate.rate() and cache.page_value_bytes == fetch.value_bytes
    closed_clean(fetch, cache, helper)


@HELPER
@pytest.mark.parametrize("local", [False, True], ids=["no-local-tier", "local-tier"])
def test_views_of_pages_the_helper_checked_are_made_by_the_taker(redis, helper, local, monkeypatch):
    """With the helper, the fetch threads build no views of pages it verified in their arena slots (each view op
    hands the GIL over, beside an engine thread launching kernels), with a local tier too (it takes its copies at
    the write-back): `take` makes them, on the engine's thread. The in-process fetch checks and parses each value
    on its fetch thread, as before."""
    import threading

    import pdserve.cache.prefix_fetch as prefix_fetch
    import pdserve.cache.prompt_cache as prompt_cache

    made: list[str] = []
    for module in (prefix_fetch, prompt_cache):
        for name in ("checked_page", "decode_value"):
            if hasattr(module, name):
                real = getattr(module, name)
                monkeypatch.setattr(
                    module, name, lambda *a, _real=real: made.append(threading.current_thread().name) or _real(*a)
                )
    cache, ns, tokens = filled(redis.url, helper=helper, local_bytes=64 << 20 if local else 0)
    if local:
        cache.local.clear()  # what the filling put there
    fetch = PrefixFetch(cache, ns, ns.page_keys(tokens), 0, N_PAGES, batch_pages=3).start()
    assert fetch.wait(N_PAGES, 10) == N_PAGES
    fetch_threads = len(made)
    pages = fetch.take(0, N_PAGES).payloads
    assert [p.page_index for p in pages] == list(range(N_PAGES))
    assert all(torch.equal(p.data, make_page(INT8, p.page_index).data) for p in pages)
    me = threading.current_thread().name
    if helper:
        assert fetch_threads == 0 and made == [me] * N_PAGES
        assert len(fetch.take(2, 5, host_views=False).payloads) == 3  # no device copy: every page's views
    else:
        assert fetch_threads == N_PAGES and me not in made
    closed_clean(fetch, cache, helper)


def test_batches_before_the_compute_are_skipped(redis):
    cache, ns, tokens = filled(redis.url)
    fetch = PrefixFetch(cache, ns, ns.page_keys(tokens), 0, N_PAGES, batch_pages=3)
    fetch.skip_to(6)  # the engine computes pages 0-5: batches [0, 3) and [3, 6) are not fetched
    assert fetch.start().wait(N_PAGES, 10) == N_PAGES and fetch.finished
    assert fetch._host.numel() == 4 * fetch._stride  # the arena holds pages 6-9 only
    assert fetch.usable_end(0) == 0 and fetch.usable_end(6) == N_PAGES and fetch.real_pages == 4
    assert [p.page_index for p in fetch.take(6, N_PAGES).payloads] == [6, 7, 8, 9]
    with pytest.raises(ValueError, match="skipped"):
        fetch.take(4, 7)
    assert cache.stats.hits == 4
    fetch.close()
    cache.close()


@HELPER
def test_fetch_stops_at_a_missing_page_and_a_forged_one(redis, helper):
    cache, ns, tokens = filled(redis.url, helper=helper)
    keys = ns.page_keys(tokens)
    client = redis.client()
    client.delete(cache.store_key(ns, keys[7]))
    name = cache.store_key(ns, keys[4])
    value = client.get(name)
    client.set(name, value[:-1] + bytes([value[-1] ^ 1]))  # a forged tag
    fetch = PrefixFetch(cache, ns, keys, 0, N_PAGES, batch_pages=3).start()
    assert fetch.wait(N_PAGES, 10) == 4 and fetch.finished
    assert cache.stats.mac_failures == 1 and cache.stats.hits == 4
    closed_clean(fetch, cache, helper)


@HELPER
def test_pages_under_a_previous_secret_land_and_are_rewritten(redis, helper):
    previous, current = "the-previous-secret-of-this-deployment-0123", "the-current-secret-of-this-deployment-01234"
    writer, ns, tokens = filled(redis.url, keyring=CacheKeyring.of(previous))
    writer.close()
    rotated = CacheKeyring.of(current, previous)
    cache = PromptCache(RedisStore(redis.url), keyring=rotated, fetch_batch_pages=4)
    assert cache.use_fetch_process(1 << 22, pin=False) if helper else True  # values come back in its replies
    keys = ns.page_keys(tokens)
    fetch = PrefixFetch(cache, ns, keys, 0, N_PAGES, batch_pages=4).start()
    assert fetch.wait(N_PAGES, 10) == N_PAGES
    assert torch.equal(fetch.take(0, 1).payloads[0].data, make_page(INT8, 0).data)
    assert cache.flush() and cache.stats.rekeyed == N_PAGES
    assert redis.client().exists(cache.store_key(ns, keys[9]))  # now under the current secret
    closed_clean(fetch, cache, helper)


@HELPER
def test_store_down_mid_fetch_ends_it_with_what_landed(start_redis, helper):
    srv = start_redis()
    cache, ns, tokens = filled(srv.url, helper=helper)
    keys = ns.page_keys(tokens)
    srv.stop()
    fetch = PrefixFetch(cache, ns, keys, 0, N_PAGES, batch_pages=3).start()
    assert fetch.wait(N_PAGES, 10) == 0 and fetch.finished
    assert cache.stats.errors >= 1 and cache.stats.hits == 0
    closed_clean(fetch, cache, helper)


def test_racing_lookups_keep_using_a_store_measured_slower(redis):
    """Racing (prefill on a GPU): a slow fetch costs nothing, so every hit fetches, whatever the measured rates."""
    cache, ns, tokens = filled(redis.url)
    for i in range(5):
        hit, fetch = cache.lookup_racing(ns, tokens, N_PAGES, prefill_tokens_per_s=1e12)
        assert hit.decision is not None and hit.decision.fetch
        assert hit.decision.reason == ("race (unmeasured)" if i == 0 else "race (slower)")
        assert fetch is not None and fetch.wait(N_PAGES, 10) == N_PAGES  # fetched all the same
        fetch.close()
    assert cache.stats.hits == 5 * N_PAGES
    cache.close()


def test_a_store_measured_slower_is_probed_again_later():
    page = 16 * 68 * 1024
    assert decide_fetch(1e9, page, 16, 40_000.0, measured_age_s=1.0).reason == "slower"
    d = decide_fetch(1e9, page, 16, 40_000.0, measured_age_s=PROBE_AFTER_S)
    assert d.fetch and d.reason == "probe"
    assert decide_fetch(1e9, page, 16, 2_000.0, measured_age_s=0.0).reason == "faster"


def test_waiting_lookup_asks_a_slower_store_again_once_its_measurement_is_old(redis):
    """Without the race (CPU engines, colocated): a store measured slower is skipped, then probed again later."""
    cache, ns, tokens = filled(redis.url)
    assert cache.lookup(ns, tokens, N_PAGES, prefill_tokens_per_s=1e12).num_pages == N_PAGES  # unmeasured: fetch
    cache.measured_fetch(1000, 1.0, 1000.0)  # then one slow moment: 1 kB/s
    skipped = cache.lookup(ns, tokens, N_PAGES, prefill_tokens_per_s=1e12)
    assert skipped.num_pages == 0 and skipped.decision.reason == "slower"
    cache.fetch_measured_at -= PROBE_AFTER_S  # ten seconds later
    probed = cache.lookup(ns, tokens, N_PAGES, prefill_tokens_per_s=1e12)
    assert probed.num_pages == N_PAGES and probed.decision.reason == "probe"
    assert cache.lookup(ns, tokens, N_PAGES, prefill_tokens_per_s=1e12).decision.reason == "slower"  # measured anew
    cache.close()


def test_the_fetch_starts_where_compute_and_fetch_meet(redis):
    """`split_page`: the chunk boundary or batch edge minimising max(compute before it, a chunk cut part-way paying
    its forward's fixed part; fetch from its batch on), with both rates; after the first chunk without them; from
    the start for one chunk or an unknown chunk."""
    cache, ns, tokens = filled(redis.url)
    keys = ns.page_keys(tokens)

    def split(batch_pages: int = 2, **kw) -> int:
        return PrefixFetch(cache, ns, keys, 0, N_PAGES, batch_pages=batch_pages, **kw).split_page()

    assert split() == 0 and split(chunk_pages=N_PAGES) == 0  # no chunk known / one chunk: all fetched
    assert split(chunk_pages=2) == 2 and split(chunk_pages=2, prefill_tokens_per_s=PAGE) == 2  # a rate unknown
    vb = PrefixFetch(cache, ns, keys, 0, 0).value_bytes
    cache.measured_fetch(10 * vb, 10.0, vb)  # the store: a page a second
    assert split(chunk_pages=2, prefill_tokens_per_s=PAGE) == 4  # a page a second each: 4 computed, 6 fetched
    assert split(chunk_pages=2, prefill_tokens_per_s=PAGE / 100) == 0  # the store far faster: all fetched
    assert split(chunk_pages=2, prefill_tokens_per_s=PAGE * 100) == 8  # far slower: the last batch still fetched
    # computing 2 pages a second, chunks of 4 (2 s each, 0.4 s of it a forward's fixed part: PART_FORWARD_SHARE):
    # 8 computed, 2 fetched (4 s against 2 s) ties with 6 (3 s + 0.2 s for the half chunk cut off, against 4 s):
    # the split that cuts no chunk
    assert split(chunk_pages=4, prefill_tokens_per_s=2 * PAGE) == 8
    # with batches of a page the cut can fall at 7: 3.5 s + 0.1 s against 3 s, sooner than any chunk boundary
    assert split(chunk_pages=4, prefill_tokens_per_s=2 * PAGE, batch_pages=1) == 7
    # at 0.9 pages a second the cut at 5 would take 5.6 s + 0.7 s (three quarters of a chunk's fixed part) against
    # 5 s; the boundary at 4 takes 4.4 s against 6 s: without the fixed part (5.6 s) the cut would have won
    assert split(chunk_pages=4, prefill_tokens_per_s=0.9 * PAGE, batch_pages=1) == 4
    # chunks of a page, batches of 2: 6 computed (3 s) against 4 fetched (4 s); a split at 7 reads page 6's batch
    # all the same (4 s against 3.5)
    assert split(chunk_pages=1, prefill_tokens_per_s=2 * PAGE) == 6
    assert split(chunk_pages=1, prefill_tokens_per_s=2 * PAGE, batch_pages=1) == 7  # 3.5 s against 3 s
    # a span of one chunk is split too: 2 pages a second, one chunk of 10 (5 s, 1 s of it fixed): 7 computed (3.5 s
    # + 0.3 s) against 3 fetched (3 s), where fetching all takes 10 s and 6 computed 4 s
    assert split(chunk_pages=N_PAGES, prefill_tokens_per_s=2 * PAGE, batch_pages=1) == 7
    fetch = PrefixFetch(cache, ns, keys, 0, N_PAGES, batch_pages=2, prefill_tokens_per_s=PAGE, chunk_pages=2)
    assert fetch.start().wait(N_PAGES, 10) == N_PAGES
    assert fetch.usable_end(0) == 0 and fetch.usable_end(4) == N_PAGES and fetch.real_pages == 6
    fetch.mark_loaded(4, 7)  # what the request's span says of it
    a = fetch.span_attributes()
    assert (a["pdserve.cache.fetch_start_page"], a["pdserve.cache.fetch_pages_fetched"]) == (4, 6)
    assert a["pdserve.cache.fetch_pages_loaded"] == 3 and a["pdserve.cache.fetch_landed_ms"] > 0
    fetch.close()
    cache.close()


@HELPER
@pytest.mark.parametrize("damage", ["checksum", "nan-scale", "other-page", "inf-data"])
def test_a_value_with_a_good_mac_but_bad_content_ends_the_fetch_as_corrupt(redis, helper, damage):
    """Values the secret's holder wrote wrong (a flipped byte re-sealed, NaN scales or infinite dense data with a
    good CRC, another page's value under this key): a miss counted as corrupt, checked in the helper as in this
    process."""
    layout = DENSE if damage == "inf-data" else INT8
    cache, ns, tokens = filled(redis.url, layout, helper=helper)
    keys = ns.page_keys(tokens)
    if damage == "inf-data":
        page = make_page(DENSE, 5)
        page.data.view(-1)[7] = float("inf")
        value = bytearray(encode_value(page, ns, keys[5]))
    elif damage == "checksum":
        value = bytearray(encode_value(make_page(INT8, 5), ns, keys[5]))
        value[-1] ^= 1
    elif damage == "nan-scale":
        page = make_page(INT8, 5)
        page.scales.view(-1)[3] = float("nan")
        value = bytearray(encode_value(page, ns, keys[5]))
    else:
        value = bytearray(encode_value(make_page(INT8, 6), ns, keys[6]))
    redis.client().set(cache.store_key(ns, keys[5]), b"".join(bytes(p) for p in KEYRING.seal(keys[5], bytes(value))))
    fetch = PrefixFetch(cache, ns, keys, 0, N_PAGES, batch_pages=3).start()
    assert fetch.wait(N_PAGES, 10) == 5 and fetch.finished
    assert cache.stats.corrupt == 1 and cache.stats.mac_failures == 0 and cache.stats.hits == 5
    closed_clean(fetch, cache, helper)
