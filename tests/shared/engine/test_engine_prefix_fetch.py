"""EngineRequest(prefix_fetch=...): cached pages fetched while the prompt computes; the engine loads those that land
before it reaches them (pdserve.engine.prefix_fetch) and computes the rest, with the same output either way."""

from __future__ import annotations

import threading
import time

import pytest
from engine_testutil import export_payloads, layout_for, random_prompt, run_to_completion

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prefix_fetch import OVERDUE_SHARE, PrefixFetch
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.store import MemoryStore, StoreError
from pdserve.cache.value_auth import CacheKeyring
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams

PAGE = 4  # make_engine: page 4, chunk 8 (two pages a chunk)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
KEYRING = CacheKeyring.of("engine-prefix-fetch-test-secret-0123456789")


class GatedStore(MemoryStore):
    """A remote-looking store whose reads wait for `gate` (one release per read); read number `fail_at` (0-based)
    and later ones raise StoreError (the store went down)."""

    remote = True

    def __init__(self):
        super().__init__(64 << 20)
        self.gate = threading.Semaphore(0)
        self.fail_at: int | None = None
        self.reads = 0

    def get_many(self, keys, ttl_ms):
        self.gate.acquire()
        n, self.reads = self.reads, self.reads + 1
        if self.fail_at is not None and n >= self.fail_at:
            raise StoreError("store down")
        return super().get_many(keys, ttl_ms)

    def touch_many(self, keys, ttl_ms):  # which exist, without the reads this store gates or slows
        with self._lock:
            return [k in self._items for k in keys]


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine("llama")


@pytest.fixture
def cached(engine):
    """(prompt, reference tokens, cache with every full page of the prompt stored, its store, namespace)."""
    prompt = random_prompt(10 * PAGE + 3, seed=91)
    ref = engine.generate([prompt], GREEDY)[0]
    engine.add_request(EngineRequest("src", prompt, GREEDY, prefill_only=True))
    while not any(o.finished for o in engine.step()):
        pass
    layout = layout_for(engine)
    pages = export_payloads(engine, "src", list(range(len(prompt) // PAGE)), layout)
    engine.release("src")
    store = GatedStore()
    cache = PromptCache(store, keyring=KEYRING, fetch_connections=1, fetch_batch_pages=2)
    ns = CacheNamespace(engine.fingerprint, layout)
    keys = ns.page_keys(prompt)
    cache.put_many(ns, list(zip(keys, pages)))
    assert cache.flush()
    yield prompt, ref, cache, store, ns
    cache.close()
    assert engine.allocator.num_used == 0  # no page leaked


def start_fetch(cache, ns, prompt, rate=None) -> PrefixFetch:
    keys = ns.page_keys(prompt)
    return PrefixFetch(cache, ns, keys, 0, (len(prompt) - 1) // PAGE, batch_pages=2, prefill_tokens_per_s=rate).start()


def split_fetch(cache, ns, prompt, batch_pages: int, prefill_tokens_per_s: float, chunk_pages: int = 2) -> PrefixFetch:
    """A fetch of the prompt's 10 pages (not started) with both rates measured: the store 5 pages a second, the
    engine `prefill_tokens_per_s`, chunks of `chunk_pages` (where it starts: `split_page`; the engine's chunks are
    2 pages: one page splits as a step whose budget other work shares would)."""
    keys = ns.page_keys(prompt)
    probe = PrefixFetch(cache, ns, keys, 0, 0)
    cache.measured_fetch(5 * probe.value_bytes, 1.0, probe.value_bytes)
    return PrefixFetch(cache, ns, keys, 0, 10, batch_pages=batch_pages, prefill_tokens_per_s=prefill_tokens_per_s,
                       chunk_pages=chunk_pages)  # fmt: skip


def landed_split_fetch(cache, store, ns, prompt, batch_pages: int, prefill_tokens_per_s: float, split: int,
                       chunk_pages: int = 2):  # fmt: skip
    """`split_fetch`, checked to start at page `split`, started, and landed whole before the engine starts (so the
    split decides what is computed, not the store's speed)."""
    fetch = split_fetch(cache, ns, prompt, batch_pages, prefill_tokens_per_s, chunk_pages)
    assert fetch.split_page() == split
    for _ in range(-(-(10 - split) // batch_pages)):
        store.gate.release()
    fetch.start()
    assert fetch.wait(10, 10) == 10
    return fetch


def run(engine, rid, prompt, fetch, prefill_only=False, before_step=None) -> tuple[list[int], list[tuple]]:
    """Tokens of a request racing `fetch`, and the token ranges its prompt chunks computed (prefill-only)."""
    engine.add_request(EngineRequest(rid, prompt, GREEDY, prefill_only=prefill_only, prefix_fetch=fetch))
    tokens, ranges, steps = [], [], 0
    while engine.has_unfinished_requests() and steps < 500:
        if before_step is not None:
            before_step(steps)
        steps += 1
        for o in engine.step():
            tokens += o.new_token_ids
            if o.token_range:
                ranges.append(o.token_range)
            if o.finished and prefill_only:
                engine.release(rid)
    return tokens, ranges


def test_fetch_landed_before_skips_every_cached_chunk(engine, cached):
    prompt, ref, cache, store, ns = cached
    fetch = start_fetch(cache, ns, prompt)
    for _ in range(5):
        store.gate.release()
    assert fetch.wait(10, 10) == 10 and fetch.finished
    tokens, _ = run(engine, "before", prompt, fetch)
    assert tokens == ref
    assert fetch.take_loaded() == list(range(10))  # every fetched page loaded: only the last 3 tokens computed
    assert cache.stats.hits == 10 and cache.stats.lookup_pages == 10


def test_prefill_only_computes_after_the_landed_pages(engine, cached):
    prompt, ref, cache, store, ns = cached
    fetch = start_fetch(cache, ns, prompt)
    for _ in range(5):
        store.gate.release()
    fetch.wait(10, 10)
    tokens, ranges = run(engine, "p", prompt, fetch, prefill_only=True)
    assert tokens == ref[:1] and ranges == [(40, 43)]  # loaded pages are not in ready_pages: shipped by the caller


def test_fetch_landing_partway_skips_some_chunks(engine, cached):
    prompt, ref, cache, store, ns = cached
    fetch = start_fetch(cache, ns, prompt)

    def before_step(step: int) -> None:
        if step == 1:  # the first chunk (pages 0-1) computed: pages 0-5 arrive before the second
            for _ in range(3):
                store.gate.release()
            fetch.wait(6, 10)

    tokens, ranges = run(engine, "partial", prompt, fetch, prefill_only=True, before_step=before_step)
    assert tokens == ref[:1]
    assert ranges[0] == (0, 8) and ranges[1] == (24, 32)  # pages 2-5 loaded, the compute went on from page 6
    assert fetch.take_loaded() == [2, 3, 4, 5]
    for _ in range(2):
        store.gate.release()


def test_fetch_landing_after_computes_everything(engine, cached):
    prompt, ref, cache, store, ns = cached
    fetch = start_fetch(cache, ns, prompt)
    tokens, _ = run(engine, "after", prompt, fetch)
    assert tokens == ref and fetch.take_loaded() == []
    for _ in range(5):
        store.gate.release()
    fetch.wait(10, 10)
    fetch.close()


def test_value_failing_its_mac_ends_the_fetch_there(engine, cached):
    prompt, ref, cache, store, ns = cached
    keys = ns.page_keys(prompt)
    name = cache.store_key(ns, keys[3])
    value, expires = store._items[name]
    store._items[name] = (value[:-1] + bytes([value[-1] ^ 1]), expires)  # a forged tag on page 3
    fetch = start_fetch(cache, ns, prompt)
    for _ in range(5):
        store.gate.release()
    assert fetch.wait(10, 10) == 3 and fetch.finished
    tokens, _ = run(engine, "mac", prompt, fetch)
    assert tokens == ref and fetch.take_loaded() == [0, 1, 2]
    assert cache.stats.mac_failures == 1 and cache.stats.hits == 3


def test_store_down_mid_fetch_computes_the_rest(engine, cached):
    prompt, ref, cache, store, ns = cached
    store.fail_at = 2
    fetch = start_fetch(cache, ns, prompt)
    for _ in range(5):
        store.gate.release()
    assert fetch.wait(10, 10) == 4 and fetch.finished
    tokens, _ = run(engine, "down", prompt, fetch)
    assert tokens == ref and fetch.take_loaded() == [0, 1, 2, 3]
    assert cache.stats.errors == 1


def test_idle_engine_waits_for_pages_measured_to_land_sooner(engine, cached):
    """Rates measured (a slow engine, the store known fast): the step waits for the landing pages instead of
    computing them; a first hit (unmeasured) never waits (test above: computes everything)."""
    prompt, ref, cache, store, ns = cached
    cache.measured_fetch(1 << 30, 1.0, 1000.0)  # the store delivered 1 GiB/s lately
    fetch = start_fetch(cache, ns, prompt, rate=1.0)  # computing 8 tokens would take 8 s
    opener = threading.Timer(0.05, lambda: [store.gate.release() for _ in range(5)])
    opener.start()
    tokens, ranges = run(engine, "wait", prompt, fetch, prefill_only=True)
    opener.join()
    assert tokens == ref[:1] and ranges == [(40, 43)]  # nothing of the cached prefix computed


def test_aborted_request_racing_a_fetch_frees_its_pages(engine, cached):
    prompt, _, cache, store, ns = cached
    # both rates known, the fetch (2 pages landed at once) far faster than the compute: the idle engine waits for
    # the stalled fetch for a chunk's predicted compute (8 tokens at 8 tokens/s: 1 s), then computes
    cache.measured_fetch(1 << 30, 1.0, 1000.0)
    fetch = start_fetch(cache, ns, prompt, rate=8.0)
    store.gate.release()
    fetch.wait(2, 10)
    engine.add_request(EngineRequest("gone", prompt, GREEDY, prefix_fetch=fetch))
    engine.step()  # loads pages 0-1 (taking the request's pages before admission), then computes
    assert engine.allocator.num_used > 0
    engine.abort("gone")
    run_to_completion(engine)
    fetch.close()
    for _ in range(4):
        store.gate.release()


def test_a_fetch_the_compute_passed_reads_no_more(engine, cached):
    prompt, ref, cache, store, ns = cached
    fetch = start_fetch(cache, ns, prompt)  # its first batch waits at the store's gate the whole time
    tokens, ranges = run(engine, "passed", prompt, fetch)
    assert tokens == ref and fetch.take_loaded() == [] and fetch.finished  # the engine passed it: cancelled
    store.gate.release()
    cache.fetch_pool().submit(lambda: None).result(10)  # one fetch thread: every batch job ran before this
    assert store.reads == 1  # the four batches after the blocked one were skipped


def test_computes_a_chunk_while_the_rest_lands_when_that_is_sooner(engine, cached):
    """Measured: fetching all 10 pages takes 2 s, computing a chunk (2 pages) 1 s, fetching the 8 after it 1.6 s:
    the engine computes the chunk at once and the fetch skips its pages."""
    prompt, ref, cache, store, ns = cached
    keys = ns.page_keys(prompt)
    probe = PrefixFetch(cache, ns, keys, 0, 0)
    cache.measured_fetch(5 * probe.value_bytes, 1.0, probe.value_bytes)  # 5 pages a second
    fetch = start_fetch(cache, ns, prompt, rate=8.0)  # 8 tokens (a chunk) a second
    engine.add_request(EngineRequest("hybrid", prompt, GREEDY, prefill_only=True, prefix_fetch=fetch))
    (out,) = engine.step()
    assert out.token_range == (0, 8) and fetch.skip_before == 2
    for _ in range(5):
        store.gate.release()
    tokens, _ = run(engine, "next", prompt, None, prefill_only=True)
    engine.release("hybrid")
    assert tokens == ref[:1]


def test_the_fetch_starts_after_the_chunks_the_engine_computes_meanwhile(engine, cached):
    """Measured: 5 pages a second from the store, 16 tokens (2 chunks) a second computed: computing 2 chunks (1 s)
    while the 6 pages after them land (1.2 s) beats the other splits, so the fetch starts at page 4; the engine
    computes those chunks without waiting for pages never fetched, then loads the rest."""
    prompt, ref, cache, store, ns = cached
    fetch = landed_split_fetch(cache, store, ns, prompt, batch_pages=2, prefill_tokens_per_s=16.0, split=4)
    tokens, ranges = run(engine, "split", prompt, fetch, prefill_only=True)
    assert tokens == ref[:1] and ranges == [(0, 8), (8, 16), (40, 43)]
    assert fetch.take_loaded() == list(range(4, 10)) and store.reads == 3  # pages 0-3 never read


def test_a_split_inside_the_first_chunk_computes_its_head_and_loads_the_rest(engine, cached):
    """Measured: 5 pages a second from the store, a page a second computed, the engine's chunks of 2 pages: the first
    chunk cut after its first page (1 s, and 0.2 s for the fixed part of the half chunk it leaves) while the other
    9 pages land (1.8 s) beats fetching all 10 (2 s) and computing the first chunk whole (2 s): one forward of a
    page, then the rest loaded."""
    prompt, ref, cache, store, ns = cached
    fetch = landed_split_fetch(cache, store, ns, prompt, batch_pages=1, prefill_tokens_per_s=float(PAGE), split=1)
    tokens, ranges = run(engine, "head", prompt, fetch, prefill_only=True)
    assert tokens == ref[:1] and ranges == [(0, PAGE), (40, 43)]
    assert fetch.take_loaded() == list(range(1, 10)) and store.reads == 9  # page 0 never read


def test_the_compute_stops_where_the_fetch_starts_inside_a_chunk(engine, cached):
    """Measured: 5 pages a second from the store and from the engine (20 tokens a second), batches of one page:
    computing 5 pages while the other 5 land is the even split, at page 5, inside the engine's third chunk. That
    chunk ends at page 5 (`prefill_stop`) instead of computing a page on its way; the rest is loaded."""
    prompt, ref, cache, store, ns = cached
    fetch = landed_split_fetch(cache, store, ns, prompt, batch_pages=1, prefill_tokens_per_s=20.0, split=5,
                               chunk_pages=1)  # fmt: skip
    tokens, ranges = run(engine, "mid", prompt, fetch, prefill_only=True)
    assert tokens == ref[:1] and ranges == [(0, 8), (8, 16), (16, 20), (40, 43)]
    assert fetch.take_loaded() == list(range(5, 10)) and store.reads == 5  # pages 0-4 never read


def test_the_chunks_before_the_stop_never_skip_the_pages_after_it(engine, cached):
    """The fetch (from page 5) still on its way while the engine computes up to it: a chunk before the stop tells
    the fetch what it covers, never past the stop (page 5 is the fetch's to land), so once it lands it is loaded."""
    prompt, ref, cache, store, ns = cached
    fetch = split_fetch(cache, ns, prompt, batch_pages=1, prefill_tokens_per_s=20.0, chunk_pages=1)
    fetch.start()
    skips: list[int] = []

    def before_step(step: int) -> None:
        skips.append(fetch.skip_before)
        if step == 3:  # the compute reached page 5: the pages land now
            for _ in range(5):
                store.gate.release()
            assert fetch.wait(10, 10) == 10

    tokens, ranges = run(engine, "held", prompt, fetch, prefill_only=True, before_step=before_step)
    assert tokens == ref[:1] and ranges == [(0, 8), (8, 16), (16, 20), (40, 43)]
    assert max(skips) == 5 and fetch.take_loaded() == list(range(5, 10))


def test_a_fetch_that_finds_nothing_where_it_starts_lifts_the_stop(engine, cached):
    """The store fails its first read (the fetch's first page, 5): nothing will land from there on, so the engine
    drops the fetch and with it the stop: its chunks take their whole budget, none ends at page 5."""
    prompt, ref, cache, store, ns = cached
    fetch = split_fetch(cache, ns, prompt, batch_pages=1, prefill_tokens_per_s=20.0, chunk_pages=1)
    store.fail_at = 0
    store.gate.release()
    fetch.start()
    fetch.wait(10, 10)
    assert fetch.finished and fetch.landed == 5 and fetch.start_page == 5
    tokens, ranges = run(engine, "miss", prompt, fetch, prefill_only=True)
    assert tokens == ref[:1] and ranges == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40), (40, 43)]
    assert fetch.take_loaded() == []
    for _ in range(4):
        store.gate.release()  # should a later batch still read, it does not hang the fixture's close


def test_an_idle_engine_does_not_wait_for_pages_the_fetch_skips(engine, cached):
    """The store known fast, the engine slow (a chunk: 8 s): waiting beats computing, but not for pages before
    where the fetch starts (they never land): those two chunks are computed first, the wait comes after them."""
    prompt, ref, cache, store, ns = cached
    cache.measured_fetch(1 << 30, 1.0, 1000.0)
    fetch = PrefixFetch(cache, ns, ns.page_keys(prompt), 0, 10, batch_pages=2, prefill_tokens_per_s=1.0)
    fetch.skip_to(4)
    step, waits, wait = [0], [], fetch.wait
    fetch.wait = lambda page_end, timeout_s: (waits.append(step[0]), wait(page_end, timeout_s))[1]  # type: ignore[method-assign]
    opener = threading.Timer(0.3, lambda: [store.gate.release() for _ in range(3)])
    opener.start()
    tokens, ranges = run(
        engine, "no-wait", prompt, fetch.start(), prefill_only=True, before_step=lambda n: step.__setitem__(0, n)
    )
    opener.join()
    assert waits and min(waits) >= 2  # steps 0 and 1 computed pages 0-3 without waiting
    assert tokens == ref[:1] and ranges == [(0, 8), (8, 16), (40, 43)] and fetch.take_loaded() == list(range(4, 10))


def test_a_fetch_in_flight_is_expected_from_its_start_not_from_now(engine, cached):
    """Before its first batch lands, a fetch's pages are expected when its whole span would land at the store's
    recent rate counted from its start (its batches are in flight together): what is left of that, and once
    overdue still a share of it, never the whole span again from now (which made an idle engine compute a chunk
    rather than wait the few ms left)."""
    prompt, ref, cache, store, ns = cached
    fetch = split_fetch(cache, ns, prompt, batch_pages=2, prefill_tokens_per_s=16.0)  # the store: 5 pages a second
    assert fetch.split_page() == 4
    fetch.start()  # the store holds every read: nothing lands
    span = (10 - 4) / 5.0  # its 6 pages at 5 a second
    assert span - 0.2 < fetch.expected_landing_s(10) <= span
    fetch.started -= 1.0  # a second in flight
    assert span - 1.2 < fetch.expected_landing_s(10) <= span - 1.0
    assert fetch.expected_landing_s(6) == pytest.approx(OVERDUE_SHARE * (6 - 4) / 5.0)  # its first 2 pages: overdue
    fetch.started -= 10.0  # overdue
    assert fetch.expected_landing_s(10) == pytest.approx(OVERDUE_SHARE * span)
    for _ in range(3):
        store.gate.release()
    assert fetch.wait(10, 10) == 10
    assert fetch.expected_landing_s(10) == 0.0
    fetch.close()


def test_an_idle_engine_waits_for_pages_while_the_device_computes(engine, cached, monkeypatch):
    """A first hit (no rate measured: the engine would compute rather than wait past its small probe budget) whose
    pages land while the device still computes the engine's last launch: the engine waits for them, for free, and
    computes none of the cached prefix. The same fetch with the device idle computes it (no busy device on CPU:
    `device_busy` stands in for the GPU's, busy for 0.5 s)."""
    prompt, ref, cache, store, ns = cached
    until = [0.0]
    monkeypatch.setattr(engine.runner, "device_busy", lambda: time.monotonic() < until[0])
    for busy_s, want in ((0.5, [(40, 43)]), (0.0, None)):
        fetch = start_fetch(cache, ns, prompt)
        opener = threading.Timer(0.15, lambda: [store.gate.release() for _ in range(5)])  # past UNMEASURED_WAIT_S
        until[0] = time.monotonic() + busy_s
        opener.start()
        tokens, ranges = run(engine, f"busy-{busy_s}", prompt, fetch, prefill_only=True)
        opener.join()
        assert tokens == ref[:1]
        if want is not None:
            assert ranges == want and fetch.take_loaded() == list(range(10))
        else:
            assert ranges[0] == (0, 8)  # computed from the start: nothing had landed, nothing was waited for
        fetch.close()
