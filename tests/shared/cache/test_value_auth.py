"""The prompt cache's keyed protection against real Redis: forged values are counted misses, key names reveal no
prompt and no tenant, secrets rotate with an overlap, Redis AUTH, and what happens without a configured secret."""

from __future__ import annotations

import dataclasses
import stat

import crc32c
import pytest
import torch
from cache_testutil import INT8, KEYRING, PAGE, make_page, namespace

from pdserve.cache.config import CacheOptions
from pdserve.cache.prompt_cache import PromptCache, build_prompt_cache
from pdserve.cache.redis_store import RedisStore, StoreRefused
from pdserve.cache.value import _block_bytes, decode_value, encoded_bytes
from pdserve.cache.value_auth import TAG_BYTES, CacheKey, CacheKeyring, keyring_from, write_secret_file

ALICE, BOB = (dataclasses.replace(namespace(), scope=s) for s in ("tenant:alice", "tenant:bob"))
OLD, NEW = "old-secret-of-this-deployment-0123456789", "new-secret-of-this-deployment-0123456789"


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cache_on(url: str, keyring: CacheKeyring = KEYRING, **kw) -> PromptCache:
    return PromptCache(RedisStore(url, timeout_s=2.0), keyring=keyring, **kw)


def fill(cache: PromptCache, ns, prompt: list[int], seed: int) -> list:
    keys = ns.page_keys(prompt)
    pages = [make_page(ns.layout, i, seed) for i in range(len(keys))]
    assert cache.put_many(ns, list(zip(keys, pages))) == len(keys)
    assert cache.flush(10)
    return pages


def same(a, b) -> bool:
    return all(
        (x is None and y is None) or torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in ((a.data, b.data), (a.scales, b.scales), (a.zeros, b.zeros))
    )


def test_forged_value_is_a_counted_miss_and_the_answer_stays_correct(redis):
    """The red team's forgery: alice's stored page-0 header, bob's page-0 data, a recomputed CRC32C. Without the
    MAC it parses as alice's page (so it would change her output); with it, it is a miss counted in mac_failures,
    and the recomputed page written back is alice's own again."""
    cache = cache_on(redis.url)
    prompt = tokens(3 * PAGE, seed=1)
    alice_pages = fill(cache, ALICE, prompt, seed=1)
    fill(cache, BOB, prompt, seed=2)
    r = redis.client()
    a_key, b_key = ALICE.page_keys(prompt)[0], BOB.page_keys(prompt)[0]
    a_name, b_name = cache.store_key(ALICE, a_key), cache.store_key(BOB, b_key)
    a_stored, b_stored = r.get(a_name), r.get(b_name)
    body = len(a_stored) - TAG_BYTES  # stored: header | CRC32C | data | MAC tag
    assert body == encoded_bytes(ALICE, 0)
    header_len = body - sum(_block_bytes(INT8)) - 4
    header, b_data = a_stored[:header_len], b_stored[header_len + 4 : body]
    forged_inner = header + crc32c.crc32c(b_data, crc32c.crc32c(header)).to_bytes(4, "little") + b_data
    assert same(decode_value(forged_inner, ALICE, a_key, 0), make_page(INT8, 0, seed=2))  # CRC alone: accepted
    attacker = CacheKey.from_secret("a-guess-of-the-attacker-0123456789abcdef")
    for n, forged in enumerate(
        [
            forged_inner + a_stored[body:],  # alice's tag kept
            forged_inner + b_stored[body:],  # bob's tag
            forged_inner + attacker.tag(a_key, forged_inner),  # a tag under a secret of the attacker's
        ],
        1,
    ):
        r.set(a_name, forged)
        hit = cache.lookup(ALICE, prompt, 3)
        assert hit.num_pages == 0 and cache.mac_failures == n and cache.corrupt == 0
    fill(cache, ALICE, prompt, seed=1)  # what the prefill does after the miss: recompute, write back
    hit = cache.lookup(ALICE, prompt, 3)
    assert hit.num_pages == 3 and all(same(g, w) for g, w in zip(hit.pages, alice_pages))
    assert r.get(a_name) == a_stored
    from pdserve.telemetry.metrics import ServiceMetrics, watch_prompt_cache

    metrics = ServiceMetrics("prefill")  # what an operator alerts on
    try:
        watch_prompt_cache(metrics, cache)
        assert metrics.registry.get_sample_value("pdserve_prompt_cache_total", {"event": "mac_failures"}) == 3
    finally:
        metrics.stop()
    cache.close()


def test_key_names_reveal_neither_prompt_nor_tenant(redis):
    """What a reader of Redis sees: names that hold no scope and nothing computable from the tokens or the
    namespace without the secret; a guessed prompt's names under another secret are not there."""
    cache = cache_on(redis.url)
    prompt = tokens(4 * PAGE, seed=3)
    fill(cache, ALICE, prompt, seed=3)
    names = redis.client().keys("*")
    assert len(names) == 4
    public = [k.hex() for k in ALICE.page_keys(prompt)] + [ALICE.root.hex()]
    for name in names:
        text = name.decode()
        assert text.startswith("pdserve:kv:") and "alice" not in text and "tenant" not in text
        suffix = text.removeprefix("pdserve:kv:")
        assert len(suffix) == 64
        assert not any(p[:12] in text for p in public)  # no chain digest, no namespace id, not even a prefix
    guess = CacheKeyring.of("someone-elses-guess-of-the-secret-0123456789")
    assert not set(guess.names("pdserve:kv:", k)[0] for k in ALICE.page_keys(prompt)) & set(names)
    assert set(names) == {cache.store_key(ALICE, k) for k in ALICE.page_keys(prompt)}
    cache.close()


def test_previous_secret_accepted_during_overlap_then_refused(redis):
    """Rotation: a value written under the previous secret still hits while that secret is listed (and is written
    again under the current one); once it is removed, such a value is a miss, and moved under a current name it
    fails the MAC."""
    r = redis.client()
    old = cache_on(redis.url, CacheKeyring.of(OLD))
    prompt, other = tokens(3 * PAGE, seed=4), tokens(3 * PAGE, seed=5)
    pages = fill(old, ALICE, prompt, seed=4)
    fill(old, ALICE, other, seed=5)
    old_name = old.store_key(ALICE, ALICE.page_keys(other)[0])
    old.close()

    overlap = cache_on(redis.url, CacheKeyring.of(NEW, OLD))
    hit = overlap.lookup(ALICE, prompt, 3)
    assert hit.num_pages == 3 and all(same(g, w) for g, w in zip(hit.pages, pages))
    assert overlap.flush(10) and overlap.stats.rekeyed == 3 and overlap.mac_failures == 0
    assert r.dbsize() == 9  # the old values stay until their TTL; the rekeyed copies are new names
    overlap.close()

    new = cache_on(redis.url, CacheKeyring.of(NEW))
    assert new.lookup(ALICE, prompt, 3).num_pages == 3  # rekeyed during the overlap
    assert new.lookup(ALICE, other, 3).num_pages == 0  # only under the removed secret: absent for this cache
    r.set(new.store_key(ALICE, ALICE.page_keys(other)[0]), r.get(old_name))  # moved under the current name
    assert new.lookup(ALICE, other, 3).num_pages == 0 and new.mac_failures == 1
    new.close()


def test_keyring_sources_and_rotation_file(tmp_path):
    path = tmp_path / "cache_secret"
    path.write_text(f"# current first, then the previous one (accepted until removed)\n{NEW}\n  {OLD}\n\n")
    ring = keyring_from(str(path), {})
    assert ring.current == CacheKey.from_secret(NEW) and ring.keys[1] == CacheKey.from_secret(OLD)
    assert keyring_from("", {"PDSERVE_CACHE_SECRET_FILE": str(path)}) == ring
    assert keyring_from("", {"PDSERVE_CACHE_SECRET": f"{NEW},{OLD}"}).keys == ring.keys
    assert keyring_from("", {}) is None
    made = write_secret_file(tmp_path / "made")
    assert stat.S_IMODE(made.stat().st_mode) == 0o400 and keyring_from(str(made), {}) is not None
    assert write_secret_file(made).read_text() != "" and stat.S_IMODE(made.stat().st_mode) == 0o400  # replaced
    for bad in ("short", f"{NEW}\n{NEW}", "# nothing\n", "has a space in the middle of it 0123456789", f"{NEW} #x"):
        with pytest.raises(SystemExit):
            CacheKeyring.parse(bad, "test")
    with pytest.raises(SystemExit, match="cannot read"):
        keyring_from(str(tmp_path / "absent"), {})
    a, b = CacheKey.from_secret(NEW), CacheKey.from_secret(OLD)
    assert a.mac_key != a.name_key and a.name(":", b"c" * 32) != b.name(":", b"c" * 32)


def test_without_a_secret(redis, tmp_path, caplog):
    """No cache secret: a Redis elsewhere refuses to start; a Redis on this host works but is private to each
    process (a second instance cannot read the first one's pages); a shared secret file makes them shared."""
    with pytest.raises(SystemExit, match="no cache secret"):
        build_prompt_cache(CacheOptions(redis_url="rediss://redis.example:6379/0"), environ={})
    prompt = tokens(2 * PAGE, seed=6)
    a = build_prompt_cache(CacheOptions(redis_url=redis.url), environ={})
    b = build_prompt_cache(CacheOptions(redis_url=redis.url), environ={})
    assert "NO CACHE SECRET" in caplog.text
    fill(a, ALICE, prompt, seed=6)
    assert a.lookup(ALICE, prompt, 2).num_pages == 2 and b.lookup(ALICE, prompt, 2).num_pages == 0
    assert b.mac_failures == 0  # other names, not failed values
    a.close()
    b.close()
    secret = write_secret_file(tmp_path / "secret")
    env = {"PDSERVE_CACHE_SECRET_FILE": str(secret)}
    c, d = (build_prompt_cache(CacheOptions(redis_url=redis.url), environ=env) for _ in range(2))
    fill(c, ALICE, prompt, seed=6)
    assert d.lookup(ALICE, prompt, 2).num_pages == 2
    c.close()
    d.close()
    embedded = build_prompt_cache(CacheOptions(), environ={})  # in-process: a random secret, nothing to share
    assert embedded is not None
    embedded.close()


def test_redis_password_and_acl_user(start_redis, tmp_path):
    """A Redis with requirepass through redis://:pass@ and through a password file; an ACL user; a wrong
    password stops the start with a clear reason."""
    srv = start_redis("--requirepass", "s3cret-pass")
    env = {"PDSERVE_CACHE_SECRET": NEW}
    prompt = tokens(2 * PAGE, seed=7)
    url = f"redis://:s3cret-pass@127.0.0.1:{srv.port}/0"
    cache = build_prompt_cache(CacheOptions(redis_url=url), environ=env)
    fill(cache, ALICE, prompt, seed=7)
    assert cache.lookup(ALICE, prompt, 2).num_pages == 2
    cache.close()
    for wrong in (f"redis://:wrong@127.0.0.1:{srv.port}/0", srv.url):
        with pytest.raises(SystemExit, match="refused the credentials"):
            build_prompt_cache(CacheOptions(redis_url=wrong), environ=env)
    pw = tmp_path / "redis_password"
    pw.write_text("s3cret-pass\n")
    via_file = build_prompt_cache(CacheOptions(redis_url=srv.url, redis_password_file=str(pw)), environ=env)
    assert via_file.lookup(ALICE, prompt, 2).num_pages == 2
    via_file.close()
    with pytest.raises(SystemExit, match="given twice"):
        build_prompt_cache(CacheOptions(redis_url=url, redis_password_file=str(pw)), environ=env)

    admin = srv.client(password="s3cret-pass")
    admin.execute_command(
        "ACL", "SETUSER", "prefill", "on", ">user-pass", "~pdserve:kv:*", "-@all", "+get", "+getex", "+set",
        "+pexpire", "+ping", "+config|get",
    )  # fmt: skip
    user_pw = tmp_path / "user_password"
    user_pw.write_text("user-pass")
    acl_env = {**env, "REDIS_PASSWORD_FILE": str(user_pw)}
    as_user = build_prompt_cache(CacheOptions(redis_url=f"redis://prefill@127.0.0.1:{srv.port}/0"), environ=acl_env)
    assert as_user.lookup(ALICE, prompt, 2).num_pages == 2
    as_user.close()
    user_pw.write_text("not-the-password")
    with pytest.raises(SystemExit, match="refused the credentials"):
        build_prompt_cache(CacheOptions(redis_url=f"redis://prefill@127.0.0.1:{srv.port}/0"), environ=acl_env)
    store = RedisStore(f"redis://:wrong@127.0.0.1:{srv.port}/0", timeout_s=2.0)
    with pytest.raises(StoreRefused, match="refused the credentials"):
        store.get_many([b"k"], 1000)
    store.close()


def test_large_batches_are_verified_on_several_threads():
    """A batch of stored values above PARALLEL_VERIFY_BYTES is MAC-checked on the verify threads, with the same
    outcome: hits up to the one forged value, which is counted."""
    from pdserve.cache import prompt_cache
    from pdserve.cache.store import MemoryStore
    from pdserve.kv.codec import KVLayoutSpec

    layout = KVLayoutSpec(dtype="float32", page_size=16, num_layers=4, num_kv_heads=8, head_dim=128)  # 512 KiB pages
    ns = namespace(layout)
    cache = PromptCache(MemoryStore(64 << 20), keyring=KEYRING)
    prompt = tokens(10 * 16, seed=8)
    pages = fill(cache, ns, prompt, seed=8)
    assert sum(p.nbytes for p in pages) >= prompt_cache.PARALLEL_VERIFY_BYTES
    hit = cache.lookup(ns, prompt, 10)
    assert hit.num_pages == 10 and all(same(g, w) for g, w in zip(hit.pages, pages))
    assert cache._verify_pool._threads  # the parallel path ran
    name = cache.store_key(ns, ns.page_keys(prompt)[6])
    stored = cache.store.get_many([name], 60_000)[0]
    cache.store.set_many([(name, stored[:100] + bytes([stored[100] ^ 1]) + stored[101:])], 60_000)
    assert cache.lookup(ns, prompt, 10).num_pages == 6 and cache.mac_failures == 1
    cache.close()
