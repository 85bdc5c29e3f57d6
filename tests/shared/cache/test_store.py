"""The byte stores behind the cache (in-process and real Redis) behave alike: TTL, refresh on hit, bounds."""

from __future__ import annotations

import time

import pytest

from pdserve.cache.redis_store import RedisStore
from pdserve.cache.store import MemoryStore, StoreError
from pdserve.testing.wait import wait_until


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        s = MemoryStore(1 << 20)
    else:
        s = RedisStore(request.getfixturevalue("redis").url, timeout_s=2.0)
    yield s
    s.close()


def test_get_set_and_order(store):
    store.set_many([(b"a", b"1"), (b"c", b"3" * 1000)], ttl_ms=60_000)
    assert store.get_many([b"a", b"b", b"c"], ttl_ms=60_000) == [b"1", None, b"3" * 1000]
    assert store.get_many([], ttl_ms=1) == []


def test_memory_store_ttl_expires_and_hits_refresh_it():
    now = [0.0]
    store = MemoryStore(1 << 20, clock=lambda: now[0])
    store.set_many([(b"keep", b"x"), (b"drop", b"y")], ttl_ms=400)
    for _ in range(3):  # 0.75 s in all: "keep" lives on because every hit resets its TTL
        now[0] += 0.25
        assert store.get_many([b"keep"], ttl_ms=400) == [b"x"]
    assert store.get_many([b"drop"], ttl_ms=400) == [None]
    assert store.touch_many([b"keep", b"never-set"], ttl_ms=400) == [True, False]
    now[0] += 0.25
    assert store.get_many([b"keep", b"never-set"], ttl_ms=400) == [b"x", None]
    now[0] += 0.5
    assert store.get_many([b"keep"], ttl_ms=400) == [None]


def test_redis_store_ttl_expires_and_hits_refresh_it(redis):
    """Refresh is read from Redis' own PTTL (no timing margins); expiry is waited for without touching."""
    store, r = RedisStore(redis.url, timeout_s=2.0), redis.client()
    store.set_many([(b"keep", b"x"), (b"drop", b"y")], ttl_ms=600_000)
    assert 590_000 < r.pttl(b"keep") <= 600_000
    for k in (b"keep", b"drop"):
        r.pexpire(k, 5_000)
    assert store.get_many([b"keep"], ttl_ms=600_000) == [b"x"]
    assert r.pttl(b"keep") > 590_000 and r.pttl(b"drop") <= 5_000  # the hit reset only its own TTL
    r.pexpire(b"keep", 5_000)
    assert store.touch_many([b"keep", b"never-set"], ttl_ms=600_000) == [True, False]
    assert r.pttl(b"keep") > 590_000 and not r.exists(b"never-set")
    store.set_many([(b"short", b"z")], ttl_ms=50)
    wait_until(lambda: not r.exists(b"short"), timeout=10, what="a 50 ms key expired")
    assert store.get_many([b"short", b"keep"], ttl_ms=600_000) == [None, b"x"]
    store.close()


def test_memory_store_is_lru_by_bytes():
    s = MemoryStore(capacity_bytes=300)
    s.set_many([(b"a", b"1" * 100), (b"b", b"2" * 100), (b"c", b"3" * 100)], ttl_ms=60_000)
    s.get_many([b"a"], ttl_ms=60_000)  # a is now the most recently used
    s.set_many([(b"d", b"4" * 100)], ttl_ms=60_000)
    assert s.get_many([b"a", b"b", b"c", b"d"], ttl_ms=60_000) == [b"1" * 100, None, b"3" * 100, b"4" * 100]
    assert s.used_bytes == 300 and s.evictions == 1
    s.set_many([(b"huge", b"x" * 301)], ttl_ms=60_000)  # larger than the whole store: not stored
    assert s.get_many([b"huge"], ttl_ms=1) == [None] and len(s) == 3


def test_redis_down_raises_store_error_fast(start_redis):
    srv = start_redis()
    s = RedisStore(srv.url, timeout_s=0.2)
    s.set_many([(b"k", b"v")], ttl_ms=60_000)
    srv.kill()
    t0 = time.monotonic()
    for _ in range(3):
        with pytest.raises(StoreError):
            s.get_many([b"k"], ttl_ms=1000)
    assert time.monotonic() - t0 < 2.0
    srv.restart()
    assert s.get_many([b"k"], ttl_ms=1000) == [None]  # reconnects by itself (empty: no persistence)
    s.close()


def test_password_and_tls(start_redis, tmp_path):
    import subprocess

    srv = start_redis("--requirepass", "s3cret")
    with pytest.raises(StoreError):
        RedisStore(srv.url).get_many([b"k"], 1000)
    s = RedisStore(f"redis://:s3cret@127.0.0.1:{srv.port}/0", timeout_s=2.0)
    s.set_many([(b"k", b"v")], 60_000)
    assert s.get_many([b"k"], 1000) == [b"v"]
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    from pdserve.testing.redis_server import RedisServer

    tls = start_redis(
        "--tls-port",
        RedisServer.FREE_PORT,
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(cert),
        "--tls-auth-clients",
        "no",
    )
    s = RedisStore(f"rediss://127.0.0.1:{tls.extra_ports[0]}/0?ssl_ca_certs={cert}", timeout_s=2.0)
    s.set_many([(b"t", b"tls")], 60_000)
    assert s.get_many([b"t"], 1000) == [b"tls"]
    s.close()


def test_redis_cluster_client(start_redis, tmp_path):
    """A one-node Redis Cluster (all 16384 slots) through redis-py's cluster client."""
    from pdserve.testing.redis_server import RedisServer

    srv = start_redis(
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        str(tmp_path / "nodes.conf"),
        "--cluster-port",
        RedisServer.FREE_PORT,
    )
    c = srv.client()
    c.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    deadline = time.monotonic() + 10
    while b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
        assert time.monotonic() < deadline, "cluster did not become ok"
        time.sleep(0.05)
    s = RedisStore(srv.url.removesuffix("/0"), cluster=True, timeout_s=2.0)
    items = [(f"pdserve:kv:{i}".encode(), bytes([i]) * 10) for i in range(20)]  # keys over many slots
    s.set_many(items, 60_000)
    assert s.get_many([k for k, _ in items] + [b"absent"], 60_000) == [v for _, v in items] + [None]
    assert s.eviction_policy() is not None
    s.close()
