"""Prompt cache on CPU: what a Redis hit saves (TTFT cold vs 50% vs 90% of the prompt cached), what a lookup costs
(Redis vs the local tier) and what a cached token costs in Redis.

    python bench/prompt_cache.py [--prompt-len 2048] [--repeats 5] [--json docs/bench/prompt_cache.json]
    python bench/prompt_cache.py --fetch-only [--device cuda:0] [--fetch-connections 8]   # redis_fetch_gbps only

Model: a random-weight Llama large enough for prefill to dominate TTFT on CPU (hidden 512, 4 layers, 8 heads /
4 KV heads, head_dim 64). Stack: router + prefill + decode as real processes (`--torch-threads 1`, int8 KV, page
16), the prefill on a private redis-server (allkeys-lru) with its local tier off, so every hit is read from Redis
(the cross-instance case). The served GPU figures of the cache tiers are bench/gpu_serving.py's `load` / `cache`.

`redis_fetch_gbps`: the background prefix fetch (`PrefixFetch`: parallel connections, values read straight into one
arena, pinned with a device copy on CUDA, every MAC and checksum checked) of a 3680-token prefix of the 8B shape (int8
KV, page 16: 230 values of ~1.1 MB) from the private redis-server, start to last page landed, median of the runs;
`redis_lookup_gbps`: the same pages through the synchronous lookup (redis-py pipeline) for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchutil import log, machine, merge_json, provenance, token_times_ms

import pdserve
from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prefix_fetch import PrefixFetch
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.redis_store import RedisStore
from pdserve.cache.value import value_bytes
from pdserve.cache.value_auth import CacheKeyring
from pdserve.cli.launch import start_stack
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload, quantize_payload
from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.redis_server import RedisServer

PAGE = 16
SHAPES = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=8192)  # fmt: skip
# every cache of the run on one secret: values are MAC'd under it, so caches without a shared one share no pages
KEYRING = CacheKeyring.generate("bench/prompt_cache.py")
LAYOUT = KVLayoutSpec(dtype="int8", page_size=PAGE, num_layers=4, num_kv_heads=4, head_dim=64, group_size=64)
LAYOUT_8B = KVLayoutSpec(dtype="int8", page_size=PAGE, num_layers=32, num_kv_heads=8, head_dim=128, group_size=64)


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft_table(router: str, rds, prompt_len: int, repeats: int) -> dict[str, tuple[float, int]]:
    """Median TTFT and cached tokens per scenario. Each scenario's prefix is cached by one request first; the
    measured requests add fresh random suffixes and run round-robin over the scenarios, so that load from other
    work on the host affects all three alike."""
    fractions = {"cold": 0.0, "50pct": 0.5, "90pct": 0.9}
    prefixes = {
        k: rand_tokens(int(prompt_len * f) // PAGE * PAGE, 1000 + i) for i, (k, f) in enumerate(fractions.items())
    }
    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in fractions}
    with pdserve.Client(router, timeout=600) as c:
        token_times_ms(c, rand_tokens(64, 0))  # warm-up
        for prefix in prefixes.values():
            if prefix:  # one request caches the prefix (its pages are written back behind the engine)
                before = rds.dbsize()
                token_times_ms(c, prefix + rand_tokens(prompt_len - len(prefix), 2000))
                deadline = time.monotonic() + 60
                while rds.dbsize() < before + len(prefix) // PAGE and time.monotonic() < deadline:
                    time.sleep(0.05)
        for r in range(repeats):
            for k, (name, prefix) in enumerate(prefixes.items()):
                times, cached = token_times_ms(c, prefix + rand_tokens(prompt_len - len(prefix), 3000 + 10 * r + k))
                runs[name].append((times[0], cached))
    out = {}
    for name, rs in runs.items():
        out[name] = (statistics.median(t for t, _ in rs), min(cached for _, cached in rs))
        log(f"{name:6s} TTFT median {out[name][0]:8.1f} ms (cached tokens {out[name][1]}, runs "
            f"{', '.join(f'{t:.0f}' for t, _ in rs)})")  # fmt: skip
    log(f"host load average during the runs: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return out


def filled_cache(
    url: str, tokens: list[int], local_bytes: int = 0, layout: KVLayoutSpec = LAYOUT, cluster: bool = False, **kw
) -> tuple[PromptCache, CacheNamespace]:
    """A PromptCache on `url` (`cluster`: a Redis Cluster node) holding int8 pages of random K/V for `tokens` (one
    page quantized, re-indexed: the bytes do not matter here), under the run's one cache secret (KEYRING)."""
    store = RedisStore(url, cluster=cluster, timeout_s=10.0)
    cache = PromptCache(store, local_bytes=local_bytes, write_queue=1 << 16, keyring=KEYRING, **kw)
    ns = CacheNamespace("bench", layout)
    dense = torch.randn(2, layout.num_layers, PAGE, layout.num_kv_heads, layout.head_dim)
    q = quantize_payload(PagePayload(0, PAGE, 0, dense, None, None), layout.group_size, False)
    for i, k in enumerate(ns.page_keys(tokens)):
        cache.put(ns, k, PagePayload(i, PAGE, 0, q.data, q.scales, None, layout.group_size))
    assert cache.flush(300)
    return cache, ns


def fetch_gbps(
    url: str,
    repeats: int,
    device: str,
    connections: int,
    n_tokens: int = 3680,
    cluster: bool = False,
    helper: bool = False,
) -> dict:
    """GB/s of fetching the 8B shape's pages of an `n_tokens` prefix: the background fetch (`PrefixFetch`, straight
    into the arena, device copy included on CUDA; `helper`: read in the fetch helper process, as a GPU prefill
    does) and the synchronous lookup, medians over `repeats` runs."""
    tokens = rand_tokens(n_tokens + 1, 4242)
    pages = n_tokens // PAGE
    cache, ns = filled_cache(url, tokens, layout=LAYOUT_8B, cluster=cluster, fetch_connections=connections)
    if helper:
        assert cache.use_fetch_process(1 << 30, pin=device.startswith("cuda"))
    keys = ns.page_keys(tokens)
    fast, sync = [], []
    for _ in range(repeats + 1):  # the first run warms the connections and the pinned allocator
        t0 = time.perf_counter()
        f = PrefixFetch(cache, ns, keys, 0, pages, device=device, batch_pages=cache.fetch_batch_pages).start()
        assert f.wait(pages, 120) == pages
        if device.startswith("cuda"):
            f.take(pages - 1, pages)  # the device copy of the last batch is queued behind its event
            torch.cuda.synchronize(device)
        fast.append(f.landed_bytes / (time.perf_counter() - t0) / 1e9)
        f.close()
        t0 = time.perf_counter()
        assert cache.lookup(ns, tokens, pages).num_pages == pages
        sync.append(f.landed_bytes / (time.perf_counter() - t0) / 1e9)
    cache.close()
    out = {"redis_fetch_gbps": round(statistics.median(fast[1:]), 2),
           "redis_lookup_gbps": round(statistics.median(sync[1:]), 2),
           "redis_fetch_connections": connections, "redis_fetch_device": device,
           "redis_fetch_helper": helper}  # fmt: skip
    log(f"fetch of {pages} pages ({f.landed_bytes / 1e6:.0f} MB, {connections} connections, {device}): "
        f"{out['redis_fetch_gbps']} GB/s (runs {', '.join(f'{g:.2f}' for g in fast[1:])}); synchronous lookup "
        f"{out['redis_lookup_gbps']} GB/s")  # fmt: skip
    return out


def lookup_ms(url: str, n_tokens: int, repeats: int, local: bool = False) -> float:
    """Median ms of looking up all pages of an `n_tokens` prompt (pipelined GETEX + checksum + parse)."""
    tokens = rand_tokens(n_tokens + 1, 77 + n_tokens)
    cache, ns = filled_cache(url, tokens, local_bytes=1 << 30 if local else 0)
    want, times = n_tokens // PAGE, []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        assert cache.lookup(ns, tokens, want).num_pages == want
        times.append((time.perf_counter() - t0) * 1e3)
    cache.close()
    return statistics.median(times[1:])


def bytes_per_token(url: str) -> tuple[float, float]:
    """(value bytes, Redis MEMORY USAGE bytes) per cached token, measured on stored pages."""
    import redis

    tokens = rand_tokens(8 * PAGE, 3)
    cache, ns = filled_cache(url, tokens)
    r = redis.Redis.from_url(url)
    keys = [cache.store_key(ns, k) for k in ns.page_keys(tokens)]
    lens = [r.strlen(k) for k in keys]
    assert lens == [value_bytes(ns, i) for i in range(len(keys))]
    usage = statistics.mean(r.memory_usage(k) for k in keys)
    cache.close()
    return statistics.mean(lens) / PAGE, usage / PAGE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="", help="merge the figures into this JSON (docs/bench/prompt_cache.json)")
    ap.add_argument("--commit", default="", help="the commit measured (a copied tree may lack git)")
    ap.add_argument("--fetch-only", action="store_true", help="only redis_fetch_gbps (no served stack)")
    ap.add_argument("--device", default="cpu", help="the fetch's engine device (cuda:0: pinned arena + device copy)")
    ap.add_argument("--fetch-connections", type=int, default=8)
    ap.add_argument("--fetch-helper", action="store_true", help="--fetch-only: read in the fetch helper process")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-cache-"))
    if args.fetch_only:
        srv = RedisServer(work / "redis", args=["--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"]).start()
        try:
            got = fetch_gbps(srv.url, args.repeats, args.device, args.fetch_connections, helper=args.fetch_helper)
        finally:
            srv.stop()
        if args.json:
            merge_json(args.json, {**got, **provenance(args.commit, machine())})
        return
    model = build_checkpoint(work / "model", arch="llama", seed=0, **SHAPES)
    redis_srv = RedisServer(work / "redis", args=["--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"]).start()
    rds = redis_srv.client()
    try:
        log(f"TTFT, prompt {args.prompt_len} tokens, {args.repeats} runs each (router+prefill+decode, int8 KV)")
        os.environ.update(REDIS_URL=redis_srv.url, PDSERVE_PREFILL_CACHE_LOCAL_MB="0")
        stack = start_stack(model, work / "stack", kv_dtype="int8", page_size=PAGE,
                            extra=["--torch-threads", "1", "--max-num-seqs", "4"])  # fmt: skip
        try:
            t = ttft_table(stack.router, rds, args.prompt_len, args.repeats)
        finally:
            stack.stop()
        rds.flushall()
        look = lookup_ms(redis_srv.url, 4096, args.repeats * 4)
        look_local = lookup_ms(redis_srv.url, 4096, args.repeats * 4, local=True)
        bpt, bpt_redis = bytes_per_token(redis_srv.url)
    finally:
        redis_srv.stop()
    log(f"lookup of a 4096-token prompt (256 pages of {value_bytes(CacheNamespace('bench', LAYOUT), 1)} B): "
        f"Redis {look:.2f} ms, local tier {look_local:.2f} ms")  # fmt: skip
    log(f"bytes per cached token (int8 g64): value {bpt:.1f}, Redis MEMORY USAGE {bpt_redis:.1f}")
    if args.json:
        merge_json(args.json, {
            **{f"ttft_ms_{k}": round(v[0], 1) for k, v in t.items()},
            "lookup_ms_4k": round(look, 2), "lookup_ms_4k_local": round(look_local, 2),
            "bytes_per_token": round(bpt, 1), "redis_bytes_per_token": round(bpt_redis, 1),
            **provenance(args.commit, machine()),
        })  # fmt: skip


if __name__ == "__main__":
    main()
