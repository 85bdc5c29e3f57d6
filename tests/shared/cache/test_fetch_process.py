"""The prefix fetch's helper process against a real redis-server: values read into the shared arena at the offsets
asked for, others returned in the reply, MACs checked under the key each row names; store errors and a dead
helper are StoreErrors, and a dead helper is started again. The arena's first-fit allocator on its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cache_testutil import INT8, KEYRING, PAGE, make_page, namespace

from pdserve.cache import fetch_process
from pdserve.cache.config import CacheOptions
from pdserve.cache.fetch_arena import ALIGN, SharedArena
from pdserve.cache.fetch_process import FetchProcess, FetchRow
from pdserve.cache.prefix_fetch import PrefixFetch
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.redis_store import RedisStore
from pdserve.cache.store import StoreError
from pdserve.cache.value_auth import TAG_BYTES, CacheKeyring
from pdserve.telemetry.metrics import ServiceMetrics, watch_prompt_cache

RING = CacheKeyring.of(
    "current-secret-of-the-fetch-process-tests-0001", "previous-secret-of-the-fetch-process-tests-01"
)


def test_arena_first_fit_merges_and_refuses_when_full():
    arena = SharedArena(10 * ALIGN)
    a, b, c = arena.alloc(3 * ALIGN), arena.alloc(1), arena.alloc(4 * ALIGN)
    assert (a.offset, b.offset, c.offset) == (0, 3 * ALIGN, 4 * ALIGN) and b.nbytes == ALIGN
    assert arena.alloc(3 * ALIGN) is None and arena.free_bytes == 2 * ALIGN
    a.tensor.fill_(7)
    assert int(arena.tensor[:ALIGN].sum()) == 7 * ALIGN  # a block is a view of the shared mapping
    arena.release(a)
    arena.release(b)  # merged with a's range: 4 aligned units free in one piece
    d = arena.alloc(4 * ALIGN)
    assert d is not None and d.offset == 0
    arena.release(c)
    arena.release(d)
    assert arena.free_bytes == arena.nbytes and arena.alloc(10 * ALIGN).offset == 0
    with pytest.raises(ValueError):
        SharedArena(0)
    arena.close()


def test_fetch_process_option_resolves_by_device():
    opts = CacheOptions()
    assert opts.fetch_process_arena(None) is None  # no race: no helper
    assert opts.fetch_process_arena(torch.device("cpu")) is None  # auto: GPU engines only
    assert opts.fetch_process_arena(torch.device("cuda", 0)) == (1024 << 20, True)
    on = CacheOptions(cache_fetch_process="on", cache_fetch_arena_mb=8)
    assert on.fetch_process_arena(torch.device("cpu")) == (8 << 20, False)
    assert CacheOptions(cache_fetch_process="off").fetch_process_arena(torch.device("cuda", 0)) is None
    with pytest.raises(SystemExit, match="--cache-fetch-process"):
        CacheOptions(cache_fetch_process="yes").validate_cache()
    with pytest.raises(SystemExit, match="--cache-fetch-arena-mb"):
        CacheOptions(cache_fetch_arena_mb=0).validate_cache()


@pytest.fixture
def helper(redis):
    proc = FetchProcess(RedisStore(redis.url, timeout_s=5.0), RING, connections=2, arena_bytes=1 << 20, pin=False)
    yield proc.start()
    proc.close()


def sealed(key_index: int, digest: bytes, value: bytes) -> bytes:
    return value + RING.keys[key_index].tag(digest, value)


def test_values_land_in_the_arena_with_their_macs_checked(redis, helper):
    client = redis.client()
    d = [bytes([i]) * 32 for i in range(5)]
    v = [bytes([65 + i]) * (1000 + i) for i in range(5)]
    client.set(b"k0", sealed(0, d[0], v[0]))
    client.set(b"k1", sealed(1, d[1], v[1]))  # under the previous secret
    client.set(b"k2", sealed(0, d[2], v[2])[:-1] + b"\0")  # a forged tag
    client.set(b"k4", sealed(0, d[4], v[4]))  # read with a size the caller did not expect
    size = lambda i: len(v[i]) + TAG_BYTES  # noqa: E731
    rows = [
        FetchRow(b"k0", 0, d[0], 0, size(0)),
        FetchRow(b"k1", 1, d[1], -1, size(1)),
        FetchRow(b"k2", 0, d[2], 4096, size(2)),
        FetchRow(b"k3", 0, d[3], 8192, size(3)),  # absent
        FetchRow(b"k4", 0, d[4], 12288, 7),
    ]
    got = helper.get_many(rows, 60_000, 1 << 20)
    assert got.lens == [size(0), size(1), size(2), None, size(4)]
    assert got.ok == [True, True, False, None, True]
    arena = helper.arena.tensor
    assert bytes(arena[: size(0)].numpy()) == sealed(0, d[0], v[0])  # written by the helper, read here
    assert bytes(arena[4096 : 4096 + size(2) - 1].numpy()) == v[2] + RING.keys[0].tag(d[2], v[2])[:-1]
    assert sorted(got.extras) == [1, 4]
    assert bytes(got.extras[1]) == sealed(1, d[1], v[1]) and bytes(got.extras[4]) == sealed(0, d[4], v[4])
    assert client.pttl(b"k0") > 0  # GETEX refreshed the TTL
    assert helper.get_many(rows[:1], 60_000, max_value_bytes=100).lens == [None]  # too large: read, dropped


def test_store_errors_come_back_as_store_errors(redis, helper):
    redis.client().rpush(b"list", b"v")
    with pytest.raises(StoreError, match="WRONGTYPE"):
        helper.get_many([FetchRow(b"list", 0, b"x" * 32, 0, 10)], 60_000, 1 << 20)
    assert helper.get_many([FetchRow(b"absent", 0, b"x" * 32, 0, 10)], 60_000, 1 << 20).lens == [None]


def test_a_dead_helper_fails_requests_and_is_started_again(redis, helper, monkeypatch):
    redis.client().set(b"k", sealed(0, b"d" * 32, b"value"))
    row = FetchRow(b"k", 0, b"d" * 32, 0, 5 + TAG_BYTES)
    assert helper.get_many([row], 60_000, 1 << 20).ok == [True]
    first, fds = helper.pid, len(os.listdir("/proc/self/fd"))
    os.kill(first, signal.SIGKILL)
    with pytest.raises(StoreError):
        helper.get_many([row], 60_000, 1 << 20)
    monkeypatch.setattr(fetch_process, "RESTART_AFTER_S", 0.0)
    deadline = time.monotonic() + 10
    while not helper.ready():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert helper.pid != first and helper.restarts == 1
    assert helper.get_many([row], 60_000, 1 << 20).ok == [True]
    assert len(os.listdir("/proc/self/fd")) == fds  # the dead helper's links closed, the new ones in their place


def test_the_helper_exits_when_closed(redis):
    proc = FetchProcess(RedisStore(redis.url), RING, connections=3, arena_bytes=1 << 16, pin=False).start()
    popen = proc._proc
    assert proc.ready() and popen.poll() is None
    proc.close()
    assert popen.poll() is not None and not proc.ready()
    with pytest.raises(StoreError, match="not running"):
        proc.get_many([FetchRow(b"k", 0, b"d" * 32, 0, 1)], 60_000, 1 << 20)


def test_the_helper_exits_when_its_engine_process_dies(redis):
    """A prefill killed outright leaves no helper behind: its links close with it, and the helper ends."""
    code = (
        "import sys, time\n"
        "from pdserve.cache.fetch_process import FetchProcess\n"
        "from pdserve.cache.redis_store import RedisStore\n"
        "from pdserve.cache.value_auth import CacheKeyring\n"
        f"p = FetchProcess(RedisStore({redis.url!r}), CacheKeyring.generate(), 2, 1 << 16, False).start()\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        helper = int(parent.stdout.readline())
        assert alive(helper)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while alive(helper):
        assert time.monotonic() < deadline, "the helper outlived its engine process"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_metrics_count_restarts_and_fetches_run_here_instead(redis, monkeypatch):
    """`/metrics` of a prefill with the helper: its free arena bytes, its restarts, and the fetches that ran in the
    engine's process because the arena was full or the helper down (they still land, only slower)."""
    metrics = ServiceMetrics("prefill")
    cache = PromptCache(RedisStore(redis.url, timeout_s=5.0), keyring=KEYRING, fetch_connections=2)
    watch_prompt_cache(metrics, cache)
    val = metrics.registry.get_sample_value
    assert val("pdserve_prompt_cache_fetch_arena_free_bytes", {}) is None  # no helper: no sample
    assert cache.use_fetch_process(1024, pin=False)  # room for one page
    ns, tokens = namespace(INT8), list(range(6 * PAGE + 1))
    keys = ns.page_keys(tokens)
    cache.put_many(ns, [(k, make_page(INT8, i)) for i, k in enumerate(keys)])
    assert cache.flush()
    assert val("pdserve_prompt_cache_fetch_arena_free_bytes", {}) == 1024
    fetch = PrefixFetch(cache, ns, keys, 0, 6, batch_pages=2).start()
    assert fetch.wait(6, 10) == 6 and fetch._block is None  # six pages do not fit: fetched here, all the same
    fetch.close()
    helper_total = lambda event: val("pdserve_prompt_cache_fetch_helper_total", {"event": event})  # noqa: E731
    assert helper_total("fallback_arena_full") == 1 and helper_total("restarts") == 0
    assert helper_total("fallback_helper_down") == 0
    proc = cache.fetch_process
    os.kill(proc.pid, signal.SIGKILL)
    proc._proc.wait(10)
    one = PrefixFetch(cache, ns, keys, 0, 1).start()  # the helper died just after its start: not restarted yet
    assert one.wait(1, 10) == 1 and one._block is None
    one.close()
    assert helper_total("fallback_helper_down") == 1
    monkeypatch.setattr(fetch_process, "RESTART_AFTER_S", 0.0)
    again = PrefixFetch(cache, ns, keys, 0, 1).start()
    assert again.wait(1, 10) == 1 and again._block is not None  # started again, read by the new helper
    again.close()
    assert helper_total("restarts") == 1
    cache.close()
