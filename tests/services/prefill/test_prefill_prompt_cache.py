"""Prompt cache through real processes: 3 prefill instances (two sharing a private redis-server, one with the
in-process cache) and two decode instances (kv auto and int8), driven through Decode.Generate with an explicit
prefill target. Output with cache hits must equal output without them (kv auto). The two Redis instances share one
cache secret (as `pdserve up` gives its stack); a value forged in Redis is a miss with exact output."""

from __future__ import annotations

import threading
import time
import uuid

import crc32c
import pytest
import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.redis_store import RedisStore
from pdserve.cache.value import _block_bytes, encoded_bytes
from pdserve.cache.value_auth import CacheKeyring, write_secret_file
from pdserve.cli.launch import start_service, wait_ready
from pdserve.kv.codec import KVLayoutSpec
from pdserve.server.grpc_util import channel
from pdserve.testing.redis_server import RedisServer
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

PAGE, CHUNK = 4, 16
ENGINE = ["--page-size", str(PAGE), "--chunk-size", str(CHUNK), "--num-pages", "512", "--torch-threads", "1"]
NO_REUSE = ["--prefix-reuse", "false"]
POOL = 3  # the prefill instance whose only reuse is its own KV pool


class Cluster:
    def __init__(self, work, model, redis: RedisServer):
        self.redis = redis
        secret = write_secret_file(work / "cache_secret")  # shared by the instances that share Redis
        self.keyring = CacheKeyring.from_file(secret)
        shared = {"REDIS_URL": redis.url, "PDSERVE_CACHE_SECRET_FILE": str(secret)}
        fast = ["--cache-timeout-ms", "300", "--cache-breaker-failures", "2", "--cache-breaker-cooldown-s", "0.3"]
        specs = [
            # p0-p2 test the prompt cache's tiers: their pools keep no prefixes (--prefix-reuse false)
            ("prefill", [*fast, "--cache-local-mb", "0", *NO_REUSE], shared),  # p0: Redis only
            ("prefill", [*fast, *NO_REUSE], shared),  # p1: local tier + Redis
            ("prefill", NO_REUSE, {"REDIS_URL": ""}),  # p2: in-process cache
            ("decode", ["--kv-dtype", "auto"], {}),
            ("decode", ["--kv-dtype", "int8"], {}),
            ("decode", ["--kv-dtype", "auto", "--kv-transport", "cuda-ipc"], {}),  # shared memory on CPU
            ("prefill", ["--prompt-cache", "false"], {"REDIS_URL": ""}),  # p3: only its pool's prefixes (default on)
        ]
        started = [
            start_service(name, ["--model", str(model), *ENGINE, *args], work, env=env) for name, args, env in specs
        ]
        self.procs = [s[0] for s in started]
        try:
            addrs = [wait_ready(*s, timeout=120) for s in started]
        except BaseException:
            self.stop()
            raise
        self.prefill, (self.decode_auto, self.decode_int8, self.decode_ipc) = addrs[:3] + addrs[6:], addrs[3:6]
        self.channels = {a: channel(a) for a in addrs}

    def generate(
        self, prefill: int, ids: list[int], max_tokens: int = 8, int8: bool = False, scope: str = "", ipc: bool = False
    ) -> tuple[list[int], int]:
        """(completion token ids, cached_tokens) of a greedy request through decode -> prefill[prefill], its pages
        cached in `scope` (DecodeRequest.cache_scope, what the router sets per tenant); `ipc`: the decode instance
        that forces the cuda-ipc transport."""
        decode = self.decode_ipc if ipc else self.decode_int8 if int8 else self.decode_auto
        req = internal_pb2.DecodeRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=ids,
            prefill_target=self.prefill[prefill],
            sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            cache_scope=scope,
        )
        tokens, cached = [], None
        for msg in internal_pb2_grpc.DecodeStub(self.channels[decode]).Generate(req, timeout=60):
            tokens += msg.token_ids
            if msg.HasField("usage"):
                cached = msg.usage.cached_tokens
        assert cached is not None and len(tokens) == max_tokens
        return tokens, cached

    def stop(self) -> None:
        for ch in getattr(self, "channels", {}).values():
            ch.close()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(20)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    work = tmp_path_factory.mktemp("cache-cluster")
    redis = RedisServer(work / "redis").start()
    c = Cluster(work, model_dir, redis)
    yield c
    c.stop()
    redis.stop()


@pytest.fixture
def rds(cluster):
    """The cluster's Redis, emptied once the earlier tests' asynchronous write-backs have landed (the instances'
    local tiers keep what they hold)."""
    client = cluster.redis.client()
    deadline, count = time.monotonic() + 10, -1
    while client.dbsize() != count and time.monotonic() < deadline:  # quiet for 0.5 s: no write-back in flight
        count = client.dbsize()
        time.sleep(0.5)
    client.flushall()
    return client


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def wait_keys(rds, n: int, timeout: float = 30.0) -> None:
    """Wait for the asynchronous write-back: at least `n` page values in Redis."""
    deadline = time.monotonic() + timeout
    while rds.dbsize() < n:
        assert time.monotonic() < deadline, f"{rds.dbsize()} keys in Redis, expected {n}"
        time.sleep(0.02)


@pytest.mark.parametrize("n", [4 * PAGE, 4 * PAGE + 1, 9 * PAGE + 3])
def test_hits_shared_across_instances_output_identical(cluster, rds, n):
    ids = prompt(n, seed=n)
    cold, cached = cluster.generate(0, ids)
    assert cached == 0
    wait_keys(rds, n // PAGE)
    want = (n - 1) // PAGE * PAGE  # full pages, the last prompt token always computed
    assert cluster.generate(1, ids) == (cold, want)  # the other instance hits what p0 wrote
    assert cluster.generate(1, ids) == (cold, want)  # now from p1's local tier
    rds.flushall()
    assert cluster.generate(1, ids) == (cold, want)  # the local tier outlives Redis' copy
    assert cluster.generate(0, ids) == (cold, 0)  # p0 has no local tier: a miss, same output


def test_scopes_never_share_pages(cluster, rds):
    """A prompt cached in one scope (a tenant's) is a miss, cached_tokens 0, in every other, through the local tier
    and through Redis alike, and a hit in its own. Each other scope is asked once: its own write-back would make it
    a hit later."""
    ids = prompt(8 * PAGE + 1, seed=11)
    cold, cached = cluster.generate(1, ids, scope="tenant:alice")
    assert cached == 0
    wait_keys(rds, 8)
    assert cluster.generate(1, ids, scope="tenant:bob") == (cold, 0)  # p1's local tier holds alice's pages
    assert cluster.generate(0, ids, scope="tenant:carol") == (cold, 0)  # p0 reads Redis only
    assert cluster.generate(0, ids, scope="") == (cold, 0)  # unscoped (no router) is a scope of its own
    assert cluster.generate(0, ids, scope="tenant:alice") == (cold, 8 * PAGE)
    assert cluster.generate(1, ids, scope="tenant:alice") == (cold, 8 * PAGE)


def test_partial_prefix_hit_at_page_boundary(cluster, rds):
    base = prompt(10 * PAGE, seed=1)
    cluster.generate(0, base)
    wait_keys(rds, 10)
    other = base[: 5 * PAGE + 2] + prompt(13, seed=2)  # shares 5 full pages, diverges inside page 5
    cold, _ = cluster.generate(2, other)  # reference: the in-process instance has never seen `base`
    assert cluster.generate(0, other) == (cold, 5 * PAGE)


def test_in_process_cache_without_redis(cluster, rds):
    ids = prompt(6 * PAGE + 2, seed=3)
    cold, cached = cluster.generate(2, ids)
    assert cached == 0
    deadline = time.monotonic() + 10
    while (warm := cluster.generate(2, ids))[1] == 0 and time.monotonic() < deadline:  # write-back is async
        time.sleep(0.05)
    assert warm == (cold, 6 * PAGE)
    assert rds.dbsize() == 0  # nothing went to Redis


def test_corrupt_value_in_redis_is_a_miss_from_there(cluster, rds, model_dir):
    ids = prompt(8 * PAGE + 1, seed=4)
    cold, _ = cluster.generate(0, ids)
    wait_keys(rds, 8)
    keys = rds.keys("pdserve:kv:*")
    ns = namespace(model_dir)
    page3 = store_name(cluster, ns, ns.page_keys(ids)[3])
    assert page3 in keys
    value = rds.get(page3)
    rds.set(page3, value[:-9] + bytes(b ^ 0xFF for b in value[-9:]))  # flip the tail (data + checksum)
    assert cluster.generate(0, ids) == (cold, 3 * PAGE)  # pages 0-2 hit, page 3 on is recomputed
    deadline = time.monotonic() + 10
    while rds.get(page3) != value:  # the recomputed page replaced the bad value
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert cluster.generate(0, ids) == (cold, 8 * PAGE)


def namespace(model_dir, scope: str = "") -> CacheNamespace:
    """The namespace of the pages the instances cache for the kv-auto decode instance."""
    from pdserve.engine.loader import model_fingerprint

    layout = KVLayoutSpec(dtype="float32", page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=16)
    return CacheNamespace(model_fingerprint(str(model_dir)), layout, scope)


def store_name(cluster, ns: CacheNamespace, digest: bytes) -> bytes:
    """The Redis key of a page as the instances name it (keyed with the cluster's cache secret)."""
    naming = PromptCache(RedisStore(cluster.redis.url), keyring=cluster.keyring)
    name = naming.store_key(ns, digest)
    naming.close()
    return name


def test_forged_value_in_redis_is_a_miss_with_exact_output(cluster, rds, model_dir):
    """The red team's forgery (issue 35): alice's stored page-0 header, bob's page-0 data, a recomputed CRC32C and
    alice's tag, under alice's key. The MAC fails: a miss (cached_tokens 0), alice's exact output, and the page
    written back replaces the forgery."""
    ids, other = prompt(4 * PAGE + 1, seed=21), prompt(4 * PAGE + 1, seed=22)
    alice_ns, bob_ns = namespace(model_dir, "tenant:alice"), namespace(model_dir, "tenant:bob")
    cold, cached = cluster.generate(0, ids, scope="tenant:alice")
    assert cached == 0
    cluster.generate(0, other, scope="tenant:bob")
    wait_keys(rds, 8)
    a_name = store_name(cluster, alice_ns, alice_ns.page_keys(ids)[0])
    b_name = store_name(cluster, bob_ns, bob_ns.page_keys(other)[0])
    a_value, b_value = rds.get(a_name), rds.get(b_name)
    body = encoded_bytes(alice_ns, 0)
    header_len = body - sum(_block_bytes(alice_ns.layout)) - 4  # header | CRC32C | data | MAC tag
    header, data = a_value[:header_len], b_value[header_len + 4 : body]
    crc = crc32c.crc32c(data, crc32c.crc32c(header)).to_bytes(4, "little")
    rds.set(a_name, header + crc + data + a_value[body:])
    assert cluster.generate(0, ids, scope="tenant:alice") == (cold, 0)
    deadline = time.monotonic() + 10
    while rds.get(a_name) != a_value:  # the recomputed page replaced the forgery
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert cluster.generate(0, ids, scope="tenant:alice") == (cold, 4 * PAGE)


def test_redis_killed_and_restarted_under_load(cluster, rds):
    prompts = [prompt(7 * PAGE + 2, seed=10 + i) for i in range(3)]
    refs = [cluster.generate(0, p)[0] for p in prompts]
    wait_keys(rds, 21)
    stop, errors, log = threading.Event(), [], []

    def client(i: int) -> None:
        while not stop.is_set():
            k = (i + len(log)) % len(prompts)
            try:
                tokens, cached = cluster.generate(0, prompts[k])
                log.append((time.monotonic(), cached, tokens == refs[k]))
            except Exception as e:
                errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(log) >= 3, timeout=30, what="requests served before the outage")
        cluster.redis.kill()
        t_kill = time.monotonic()
        wait_until(lambda: any(t > t_kill and c == 0 for t, c, _ in log), timeout=30, what="a miss in the outage")
        cluster.redis.restart()
        t_back = time.monotonic()
        # back to hits by itself: breaker probe, write-back refills the empty server
        wait_until(lambda: any(t > t_back and c > 0 for t, c, _ in log), timeout=20, what="a hit after the restart")
    finally:
        stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert all(same for _, _, same in log)  # hit, miss or outage: always the same output
    assert any(t_kill < t < t_back and c == 0 for t, c, _ in log)  # served as misses while Redis was down
    assert any(t > t_back and c > 0 for t, c, _ in log)  # recovered


def test_int8_cache_hits_through_the_real_path(cluster, rds):
    """int8 pages are cached as shipped; a hit's prefill attends over the dequantized prefix (measured in
    bench/prompt_cache.py). The first token and most of the continuation agree with a cold run."""
    agree = total = 0
    for i, n in enumerate([6 * PAGE + 1, 11 * PAGE + 2, 15 * PAGE + 3]):
        ids = prompt(n, seed=40 + i)
        cold, cached = cluster.generate(0, ids, max_tokens=12, int8=True)
        assert cached == 0
        wait_keys(rds, sum(m // PAGE for m in [6 * PAGE + 1, 11 * PAGE + 2, 15 * PAGE + 3][: i + 1]))
        warm, cached = cluster.generate(0, ids, max_tokens=12, int8=True)
        assert cached == (n - 1) // PAGE * PAGE
        assert warm[0] == cold[0]
        agree += sum(a == b for a, b in zip(cold, warm))
        total += len(cold)
    print(f"int8 cold vs warm greedy agreement {agree}/{total}")
    assert agree / total >= 0.6, (agree, total)


def sent(cluster, prefill: int, transport: str, after: int = -1) -> tuple[int, int, int]:
    """(requests, pages, batches) prefill[prefill] has sent over `transport`, once it has booked more than `after`
    requests (it books one when the Prefill RPC ends, which may be just after the client has its answer)."""
    return wait_until(lambda: _sent_now(cluster, prefill, transport, after), what=f"prefill booked > {after}")


def _sent_now(cluster, prefill: int, transport: str, after: int) -> tuple[int, int, int] | None:
    with channel(cluster.prefill[prefill]) as ch:
        st = internal_pb2_grpc.PrefillStub(ch).Stats(internal_pb2.StatsRequest(), timeout=10)
    got = next(((t.requests, t.pages, t.batches) for t in st.kv_transports if t.transport == transport), (0, 0, 0))
    return got if got[0] > after else None


@pytest.mark.parametrize("n", [6 * PAGE + 1, 2 * CHUNK + 3 * PAGE])
def test_cached_prefix_over_cuda_ipc(cluster, rds, n):
    """A cached prefix over cuda-ipc: every page of the prompt crosses exactly once, over cuda-ipc (the prefix as
    its own batch from the engine's upload, after its import), and the output equals the uncached one over grpc."""
    ids = prompt(n, seed=40 + n)
    cold, cached = cluster.generate(1, ids)  # over grpc: the reference, and it writes the pages
    assert cached == 0
    want = (n - 1) // PAGE * PAGE
    r0, p0, b0 = sent(cluster, 1, "cuda-ipc")
    assert cluster.generate(1, ids, ipc=True) == (cold, want)  # p1's local tier
    rds.flushall()
    r1, p1, b1 = sent(cluster, 1, "cuda-ipc", after=r0)
    assert (r1 - r0, p1 - p0) == (1, -(-n // PAGE))
    assert b1 - b0 == 1 + -(-(n - want) // CHUNK)  # the cached rows, then one batch per computed chunk
    cold_ipc, cached = cluster.generate(0, ids, ipc=True)  # p0 (Redis only, now empty): a miss over cuda-ipc
    assert (cold_ipc, cached) == (cold, 0)


@pytest.mark.parametrize("n", [4 * PAGE, 4 * PAGE + 1, 2 * CHUNK + 3 * PAGE + 2])
def test_pool_prefix_reuse_output_identical_on_every_transport(cluster, rds, n):
    """p3 has no prompt cache: a hit can only be its pool's own pages. They start the request with no compute and
    no copy, ship to decode with the computed ones (grpc, cuda-ipc, and quantized to int8), and every output equals
    the cold one; nothing goes to Redis."""
    ids = prompt(n, seed=300 + n)
    want = (n - 1) // PAGE * PAGE
    cold, cached = cluster.generate(POOL, ids)
    assert cached == 0
    assert cluster.generate(POOL, ids) == (cold, want)
    assert cluster.generate(POOL, ids, ipc=True) == (cold, want)
    cold8, cached8 = cluster.generate(POOL, ids, int8=True)  # another KV layout: another namespace, computed once
    assert cached8 == 0
    assert cluster.generate(POOL, ids, int8=True) == (cold8, want)
    longer = ids[:want] + prompt(7, seed=400 + n)  # shares the full pages, then diverges
    assert cluster.generate(POOL, longer)[1] == want
    assert rds.dbsize() == 0


def test_pool_prefixes_never_cross_scopes(cluster, rds):
    ids = prompt(6 * PAGE + 1, seed=12)
    cold, _ = cluster.generate(POOL, ids, scope="tenant:alice")
    assert cluster.generate(POOL, ids, scope="tenant:bob") == (cold, 0)
    assert cluster.generate(POOL, ids, scope="tenant:alice") == (cold, 6 * PAGE)
