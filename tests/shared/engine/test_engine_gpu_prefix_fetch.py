"""A prefix fetch for a CUDA engine: pages land in pinned memory, reach the device on a side stream, and the engine
scatters them from there (its stream waiting on their copy). Same output as the host import of the same pages
(`cached_pages`), CUDA only; also through the fetch helper process (a real redis-server, the shared arena
registered with CUDA)."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import export_payloads, layout_for, random_prompt

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prefix_fetch import PrefixFetch
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.redis_store import RedisStore
from pdserve.cache.store import MemoryStore
from pdserve.cache.value_auth import CacheKeyring
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.testing.redis_server import RedisServer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PAGE = 16


class RemoteMemoryStore(MemoryStore):
    remote = True  # values read through the fetch's copy path, as from Redis

    def touch_many(self, keys, ttl_ms):  # which exist, without the reads this store gates or slows
        with self._lock:
            return [k in self._items for k in keys]


def cached_prompt(make_engine, kv_dtype: str):
    """A CUDA engine (chunks of 2 pages), a prompt of 9 full pages and 5 tokens, its pages exported in the engine's
    layout, and the tokens the host import of those pages gives."""
    engine = make_engine("llama", device="cuda", dtype="bfloat16", page_size=PAGE, chunk_size=32, kv_dtype=kv_dtype)
    prompt = random_prompt(9 * PAGE + 5, seed=3)
    engine.add_request(EngineRequest("src", prompt, GREEDY, prefill_only=True))
    while not any(o.finished for o in engine.step()):
        pass
    layout = layout_for(engine, kv_dtype)
    pages = export_payloads(engine, "src", list(range(9)), layout)
    engine.release("src")
    engine.add_request(EngineRequest("ref", prompt, GREEDY, cached_pages=pages))  # the host import of the same pages
    ref: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            ref += o.new_token_ids
    return engine, prompt, layout, pages, ref


def generate(engine, rid: str, prompt: list[int], fetch: PrefixFetch) -> list[int]:
    """The tokens of a request racing `fetch`."""
    engine.add_request(EngineRequest(rid, prompt, GREEDY, prefix_fetch=fetch))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
    return out


@pytest.mark.parametrize("helper", [False, True], ids=["threads", "helper"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_cuda_fetch_loads_from_the_device_arena(make_engine, kv_dtype, helper, tmp_path):
    engine, prompt, layout, pages, ref = cached_prompt(make_engine, kv_dtype)
    redis = RedisServer(tmp_path / "redis").start() if helper else None
    store = RedisStore(redis.url, timeout_s=5.0) if redis else RemoteMemoryStore(64 << 20)
    cache = PromptCache(store, keyring=CacheKeyring.generate(), fetch_connections=2)
    if helper:
        assert cache.use_fetch_process(64 << 20, pin=True)
    ns = CacheNamespace(engine.fingerprint, layout)
    keys = ns.page_keys(prompt)
    cache.put_many(ns, list(zip(keys, pages)))
    assert cache.flush()
    fetch = PrefixFetch(cache, ns, keys, 0, 9, device=engine.runner.device, batch_pages=4).start()
    assert fetch.wait(9, 30) == 9
    assert fetch.take(0, 9).upload is not None and fetch._host.is_pinned()
    assert (fetch._block is not None) == helper  # the helper wrote the shared arena
    out = generate(engine, "hit", prompt, fetch)
    assert fetch.take_loaded() == list(range(9))  # every cached page loaded, none computed
    assert out == ref  # the same bytes in the pool as the host import's, the same compute after them
    fetch.close()
    cache.close()
    if redis:
        redis.stop()
    fetch.close()
    cache.close()
    assert engine.allocator.num_used == 0


def test_cuda_fetch_split_inside_a_chunk_stops_the_compute_there(make_engine):
    """Measured rates put the fetch's start at page 5, inside the engine's third 2-page chunk: that chunk ends at
    page 5 (`Sequence.prefill_stop`), pages 5-8 load from the device arena, and the output is the host import's."""
    engine, prompt, layout, pages, ref = cached_prompt(make_engine, "int8")
    cache = PromptCache(RemoteMemoryStore(64 << 20), keyring=CacheKeyring.generate(), fetch_connections=2)
    ns = CacheNamespace(engine.fingerprint, layout)
    keys = ns.page_keys(prompt)
    cache.put_many(ns, list(zip(keys, pages)))
    assert cache.flush()
    probe = PrefixFetch(cache, ns, keys, 0, 0)
    cache.measured_fetch(5 * probe.value_bytes, 1.0, probe.value_bytes)  # the store: 5 pages a second
    # chunk_pages=1 (the engine's chunk is 2 pages): a split as a step whose token budget other work shares makes
    fetch = PrefixFetch(cache, ns, keys, 0, 9, device=engine.runner.device, batch_pages=1,
                        prefill_tokens_per_s=6.0 * PAGE, chunk_pages=1)  # fmt: skip
    assert fetch.split_page() == 5  # computing 5 pages (0.83 s) beside fetching 4 (0.8 s)
    assert fetch.start().wait(9, 30) == 9
    out = generate(engine, "split", prompt, fetch)
    assert fetch.take_loaded() == list(range(5, 9)) and out == ref  # page 5 loaded: no chunk computed across it
    fetch.close()
    cache.close()
    assert engine.allocator.num_used == 0
