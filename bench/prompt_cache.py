"""Prompt cache figures on CPU: TTFT cold vs 50% vs 90% cached, lookup latency, bytes per cached token, whether
decode should fetch cached pages from Redis itself, what the local tier adds, and (--quality) the effect of
prefilling over an int8 cached prefix.

    python bench/prompt_cache.py [--prompt-len 2048] [--repeats 5] [--quality] [--json docs/bench/prompt_cache.json]

Model: a random-weight Llama large enough for prefill to dominate TTFT on CPU (hidden 512, 4 layers, 8 heads /
4 KV heads, head_dim 64). Stack: router + prefill + decode as real processes (`--torch-threads 1`, kv int8, page
16), the prefill on a private redis-server (allkeys-lru) with its local tier off, so every hit is read from Redis
(the cross-instance case).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import pdserve
from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.redis_store import RedisStore
from pdserve.cache.value import value_bytes
from pdserve.cli.launch import start_stack
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload, quantize_payload
from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.redis_server import RedisServer

sys.path.insert(0, str(Path(__file__).parent))
from kv_stream import StreamingPrefill

PAGE = 16
SHAPES = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
)
LLAMA8B = dict(num_layers=32, num_kv_heads=8, head_dim=128)


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def layout(num_layers: int, num_kv_heads: int, head_dim: int) -> KVLayoutSpec:
    return KVLayoutSpec(
        dtype="int8", page_size=PAGE, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, group_size=64
    )


def synthetic_pages(lay: KVLayoutSpec, n: int) -> list[PagePayload]:
    """int8 pages of random K/V in `lay` (one dense page quantized, re-indexed: the bytes do not matter here)."""
    dense = torch.randn(2, lay.num_layers, PAGE, lay.num_kv_heads, lay.head_dim)
    q = quantize_payload(PagePayload(0, PAGE, 0, dense, None, None), lay.group_size, False)
    return [PagePayload(i, PAGE, 0, q.data, q.scales, None, lay.group_size) for i in range(n)]


def page_value_bytes(lay: KVLayoutSpec) -> int:
    """Bytes of one cached page's value (page 1 of the "bench" namespace; other indices differ by a byte or two)."""
    return value_bytes(CacheNamespace("bench", lay), 1)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ---- TTFT through the real stack -------------------------------------------------------------------------------
def ttft(client: pdserve.Client, ids: list[int]) -> tuple[float, int]:
    t0, first, cached = time.perf_counter(), None, -1
    for ch in client.stream(token_ids=ids, max_tokens=2, temperature=0, ignore_eos=True):
        if first is None and ch.token_ids:
            first = (time.perf_counter() - t0) * 1e3
        if ch.usage is not None:
            cached = ch.usage.cached_tokens
    return first, cached


def wait_keys(rds, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while rds.dbsize() < n and time.monotonic() < deadline:
        time.sleep(0.05)


def ttft_table(router: str, rds, prompt_len: int, repeats: int) -> dict[str, tuple[float, int]]:
    """Median TTFT and cached tokens per scenario. Each scenario's prefix is cached by one request first; the
    measured requests add fresh random suffixes and run round-robin over the scenarios, so that load from other
    work on the host affects all three alike."""
    scenarios = {"cold": 0.0, "50pct": 0.5, "90pct": 0.9}
    prefixes = {
        name: rand_tokens(int(prompt_len * frac) // PAGE * PAGE, 1000 + i)
        for i, (name, frac) in enumerate(scenarios.items())
    }
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in scenarios}
    with pdserve.Client(router, timeout=600) as c:
        ttft(c, rand_tokens(64, 0))  # warm-up
        for prefix in prefixes.values():
            if prefix:  # one request caches the prefix (its pages are written back asynchronously)
                before = rds.dbsize()
                ttft(c, prefix + rand_tokens(prompt_len - len(prefix), 2000))
                wait_keys(rds, before + len(prefix) // PAGE)
        for r in range(repeats):
            for k, (name, prefix) in enumerate(prefixes.items()):
                runs[name].append(ttft(c, prefix + rand_tokens(prompt_len - len(prefix), 3000 + 10 * r + k)))
    out = {}
    for name, rs in runs.items():
        out[name] = (statistics.median(t for t, _ in rs), min(cached for _, cached in rs))
        print(
            f"  {name:6s} TTFT median {out[name][0]:8.1f} ms  (cached tokens {out[name][1]}, "
            f"runs {', '.join(f'{t:.0f}' for t, _ in rs)})",
            flush=True,
        )
    print(f"  (host load average during the runs: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    return out


# ---- lookup, bytes, decode-fetch decision (in-process against the same Redis) -----------------------------------
def filled_cache(
    url: str, lay: KVLayoutSpec, tokens: list[int], local_bytes: int = 0
) -> tuple[PromptCache, CacheNamespace]:
    cache = PromptCache(RedisStore(url, timeout_s=10.0), local_bytes=local_bytes, write_queue=1 << 16)
    ns = CacheNamespace("bench", lay)
    for k, p in zip(ns.page_keys(tokens), synthetic_pages(lay, len(tokens) // PAGE)):
        cache.put(ns, k, p)
    assert cache.flush(120)
    return cache, ns


def lookup_ms(url: str, lay: KVLayoutSpec, n_tokens: int, repeats: int, local: bool = False) -> float:
    tokens = rand_tokens(n_tokens + 1, 77 + n_tokens)
    cache, ns = filled_cache(url, lay, tokens, local_bytes=1 << 30 if local else 0)
    want = n_tokens // PAGE

    def once():
        assert cache.lookup(ns, tokens, want).num_pages == want

    ms = median_ms(once, repeats)
    cache.close()
    return ms


def stream_ms(lay: KVLayoutSpec, n_pages: int, repeats: int) -> float:
    """The same pages over a real loopback gRPC Prefill stream, verified and decoded (today's decode path)."""
    from pdserve.kv.codec import decode_page, encode_page
    from pdserve.server.grpc_util import bind, channel, make_server
    from pdserve.v1 import internal_pb2, internal_pb2_grpc

    msgs = [
        encode_page(p, request_id="b", seq_no=i, layout=lay, fingerprint="f")
        for i, p in enumerate(synthetic_pages(lay, n_pages))
    ]
    server = make_server(4, 16)
    internal_pb2_grpc.add_PrefillServicer_to_server(StreamingPrefill(msgs), server)
    port = bind(server, "127.0.0.1", 0)
    server.start()
    with channel(f"127.0.0.1:{port}") as ch:
        stub = internal_pb2_grpc.PrefillStub(ch)
        req = internal_pb2.PrefillClientMessage(request=internal_pb2.PrefillRequest(request_id="b"))

        def once():
            for m in stub.Prefill(iter([req])):
                if m.HasField("page"):
                    decode_page(m.page, expected_layout=lay, expected_fingerprint="f", expected_request_id="b")

        ms = median_ms(once, repeats)
    server.stop(0)
    return ms


def suffix_ms(model: Path, url: str, prompt_len: int, cached_tokens: int, repeats: int) -> float:
    """Prefill engine time for the uncached suffix of a prompt whose first `cached_tokens` are cached (int8)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    eng = LLMEngine(
        EngineConfig(
            model_dir=str(model),
            device="cpu",
            dtype="float32",
            page_size=PAGE,
            num_pages=prompt_len // PAGE + 2,
            max_num_seqs=1,
        )
    )
    mc = eng.model_config
    cache, ns = filled_cache(url, layout(mc.num_layers, mc.num_kv_heads, mc.head_dim), rand_tokens(prompt_len, 5))
    prompt = rand_tokens(prompt_len, 5)
    pages = cache.lookup(ns, prompt, cached_tokens // PAGE).pages
    cache.close()

    def once():
        eng.add_request("s", prompt, SamplingParams(max_tokens=1, temperature=0), prefill_only=True, cached_pages=pages)
        while not any(o.finished for o in eng.step()):
            pass
        eng.release("s")

    return median_ms(once, repeats)


def bytes_per_token(url: str, lay: KVLayoutSpec) -> tuple[float, float]:
    """(value bytes, Redis MEMORY USAGE bytes) per cached token, measured on stored pages."""
    import redis

    tokens = rand_tokens(8 * PAGE, 3)
    cache, ns = filled_cache(url, lay, tokens)
    r = redis.Redis.from_url(url)
    keys = [cache.store_key(ns, k) for k in ns.page_keys(tokens)]
    lens = [r.strlen(k) for k in keys]
    assert lens == [value_bytes(ns, i) for i in range(len(keys))]
    strlen = statistics.mean(lens)
    usage = statistics.mean(r.memory_usage(k) for k in keys)
    cache.close()
    return strlen / PAGE, usage / PAGE


def local_tier_workload(url: str, lay: KVLayoutSpec, local_mb: float, requests: int = 240) -> dict[str, float]:
    """Two prefill instances (PromptCaches) share Redis; 8 system prompts of 1024 tokens with Zipf(1.1)
    popularity + a unique 256-token suffix per request, requests alternate between the instances."""
    import redis

    redis.Redis.from_url(url).flushall()
    caches = [
        PromptCache(RedisStore(url, timeout_s=10.0), local_bytes=int(local_mb * 2**20), write_queue=1 << 16)
        for _ in range(2)
    ]
    ns = CacheNamespace("bench-local", lay)
    systems = [rand_tokens(1024, 500 + i) for i in range(8)]
    weights = torch.tensor([1 / (i + 1) ** 1.1 for i in range(8)])
    pick = torch.multinomial(weights, requests, replacement=True, generator=torch.Generator().manual_seed(0))
    page = synthetic_pages(lay, 1)[0]
    times = []
    for i, s in enumerate(pick.tolist()):
        cache = caches[i % 2]
        prompt = systems[s] + rand_tokens(256, 10_000 + i)
        t0 = time.perf_counter()
        hit = cache.lookup(ns, prompt, (len(prompt) - 1) // PAGE)
        times.append((time.perf_counter() - t0) * 1e3)
        for j in range(hit.num_pages, len(hit.keys)):  # "compute" the rest and write it back
            cache.put(ns, hit.keys[j], PagePayload(j, PAGE, 0, page.data, page.scales, None, lay.group_size))
        cache.flush(60)
    snaps = [c.stats.snapshot() for c in caches]
    for c in caches:
        c.close()
    asked = sum(s["lookup_pages"] for s in snaps)
    return dict(
        hit_ratio=sum(s["hits"] for s in snaps) / asked,
        local_ratio=sum(s["local_hits"] for s in snaps) / asked,
        lookup_ms=statistics.mean(times),
    )


# ---- quality of prefill over an int8 cached prefix ---------------------------------------------------------------
def quality(work: Path) -> None:
    """Teacher-forced continuation on a trained tiny model: int8 P->D without cache vs with an int8 cached prefix
    (prefill computes the rest attending over the dequantized prefix), all against unquantized pages; plus the
    prefill's first-token logits (what samples the first token) with a cached prefix vs without."""
    from transformers import AutoTokenizer

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams
    from pdserve.models.train_tiny import split_corpus, train_tiny_checkpoint

    model = train_tiny_checkpoint(work / "trained", seconds=45, seed=0)
    ids = AutoTokenizer.from_pretrained(str(model))(split_corpus()[1])["input_ids"]
    n_prompt, n_forced, n_cases = 112, 64, 8
    stride = (len(ids) - 200) // n_cases
    cases = [
        (ids[i * stride : i * stride + n_prompt], ids[i * stride + n_prompt : i * stride + n_prompt + n_forced])
        for i in range(n_cases)
    ]

    def eng(kv: str) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model_dir=str(model),
                device="cpu",
                page_size=PAGE,
                chunk_size=64,
                num_pages=64,
                max_num_seqs=1,
                kv_dtype=kv,
            )
        )

    pre = eng("auto")
    greedy = SamplingParams(max_tokens=n_forced, temperature=0.0, ignore_eos=True)

    def prefill(prompt, kv, cached=None) -> tuple[list[PagePayload], torch.Tensor]:
        """(pages as shipped: the cached ones as stored + the computed ones, first-token logits)."""
        pre.add_request(
            "p", prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True, cached_pages=cached
        )
        row = None
        while row is None:
            row = next((o.logits for o in pre.step(return_logits=True) if o.finished), None)
        n = len(cached or [])
        pages = list(cached or []) + pre.export_pages("p", list(range(n, -(-len(prompt) // PAGE))), kv)
        pre.release("p")
        return pages, row

    def decode(de: LLMEngine, prompt, forced, pages) -> torch.Tensor:
        de.begin_import("d", prompt, greedy)
        de._seqs["d"].forced_token_ids = list(forced)  # teacher forcing on an import (engine internals, as the
        for p in pages:  # int8 quality test does)
            de.import_page("d", p)
        de.finish_import("d", forced[0])
        rows = []
        while de.has_unfinished_requests():
            rows += [o.logits for o in de.step(return_logits=True) if o.logits is not None]
        return torch.stack(rows)  # [n_forced - 1, V]

    dense_de, int8_de = eng("auto"), eng("int8")
    variants = {"fp32 pages": None, "int8, no cache": 0, "int8, 43% cached": 48, "int8, 86% cached": 96}
    logits: dict[str, list[torch.Tensor]] = {k: [] for k in variants}
    first: dict[str, list[torch.Tensor]] = {k: [] for k in variants}
    for prompt, forced in cases:
        int8_pages, _ = prefill(prompt, "int8")  # what an earlier request would have cached
        for name, n_cached in variants.items():
            kv = "auto" if n_cached is None else "int8"
            pages, row = prefill(prompt, kv, int8_pages[: n_cached // PAGE] if n_cached else None)
            logits[name].append(decode(dense_de if n_cached is None else int8_de, prompt, forced, pages))
            first[name].append(row)
    target = torch.tensor([t for _, f in cases for t in f[1:]])
    base, base_first = torch.cat(logits["fp32 pages"]), torch.stack(first["fp32 pages"])
    print(
        f"\nquality: trained tiny llama, {n_cases} held-out prompts of {n_prompt} tokens, {n_forced} forced "
        f"tokens ({target.numel()} scored decode positions) + the prefill's first-token logits"
    )
    print(
        f"  {'pages':18s} {'ppl':>8s} {'ppl ratio':>10s} {'top-1 vs fp32':>14s} {'max |dlogit|':>13s} "
        f"{'first-token max |dlogit|':>25s}"
    )
    ppl_base = math.exp(torch.nn.functional.cross_entropy(base, target).item())
    for name in variants:
        lg = torch.cat(logits[name])
        ppl = math.exp(torch.nn.functional.cross_entropy(lg, target).item())
        agree = (lg.argmax(-1) == base.argmax(-1)).float().mean().item()
        d_first = (torch.stack(first[name]) - base_first).abs().max().item()
        print(
            f"  {name:18s} {ppl:8.3f} {ppl / ppl_base:10.5f} {agree:14.4f} {(lg - base).abs().max().item():13.4f} "
            f"{d_first:25.4f}"
        )


# ---- main --------------------------------------------------------------------------------------------------------
def machine() -> str:
    cpu = (
        next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else ""
    )
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()}-core {platform.machine()} {cpu}, {mem:.0f} GiB, no GPU, torch {torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quality", action="store_true", help="also train a tiny model (~45 s) and measure quality")
    ap.add_argument("--json", default="", help="write the headline figures here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-cache-"))
    model = build_checkpoint(work / "model", arch="llama", seed=0, **SHAPES)
    redis_srv = RedisServer(work / "redis", args=["--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"]).start()
    rds = redis_srv.client()
    bench_layout = layout(
        SHAPES["num_hidden_layers"],
        SHAPES["num_key_value_heads"],
        SHAPES["hidden_size"] // SHAPES["num_attention_heads"],
    )
    try:
        print(f"TTFT, prompt {args.prompt_len} tokens, {args.repeats} runs each (router+prefill+decode, kv int8):")
        os.environ.update(REDIS_URL=redis_srv.url, PDSERVE_PREFILL_CACHE_LOCAL_MB="0")
        stack = start_stack(
            model,
            work / "stack",
            kv_dtype="int8",
            page_size=PAGE,
            extra=["--torch-threads", "1", "--max-num-seqs", "4"],
        )
        try:
            t = ttft_table(stack.router, rds, args.prompt_len, args.repeats)
        finally:
            stack.stop()
        rds.flushall()

        n90 = int(args.prompt_len * 0.9) // PAGE * PAGE
        look = lookup_ms(redis_srv.url, bench_layout, 4096, args.repeats * 4)
        look_local = lookup_ms(redis_srv.url, bench_layout, 4096, args.repeats * 4, local=True)
        bpt, bpt_redis = bytes_per_token(redis_srv.url, bench_layout)
        print(
            f"\nlookup of a 4096-token prompt (256 pages of {page_value_bytes(bench_layout)} B): Redis {look:.2f} ms, "
            f"local tier {look_local:.2f} ms"
        )
        fp32_layout = KVLayoutSpec(
            "float32", PAGE, bench_layout.num_layers, bench_layout.num_kv_heads, bench_layout.head_dim
        )
        print(
            f"bytes per cached token (int8 g64): value {bpt:.1f}, Redis MEMORY USAGE {bpt_redis:.1f} "
            f"(fp32 pages would be {page_value_bytes(fp32_layout) / PAGE:.0f})"
        )

        print(f"\ndecode fetch from Redis vs receive from prefill: the {n90}-token cached prefix of the 90% case")
        sfx = suffix_ms(model, redis_srv.url, args.prompt_len, n90, args.repeats)
        print(f"  {'pages':34s} {'Redis GET+parse ms':>19s} {'gRPC stream+decode ms':>22s} {'suffix prefill ms':>18s}")
        for name, lay in (("bench model", bench_layout), ("Llama-3-8B-shaped", layout(**LLAMA8B))):
            rds.flushall()
            fetch = lookup_ms(redis_srv.url, lay, n90, max(3, args.repeats // 2))
            ship = stream_ms(lay, n90 // PAGE, max(3, args.repeats // 2))
            print(
                f"  {name + f' ({page_value_bytes(lay)} B/page)':34s} {fetch:19.1f} {ship:22.1f} "
                f"{f'{sfx:.1f}' if name == 'bench model' else 'n/a (GPU)':>18s}"
            )
            if name == "bench model":
                print(
                    f"  {'':34s} TTFT 90% - (prefill's lookup + suffix prefill) = "
                    f"{t['90pct'][0] - fetch - sfx:.1f} ms of transfer/RPC overhead left to remove"
                )
        rds.flushall()

        print(
            "\nlocal tier: 2 prefill instances sharing Redis, 8 system prompts x 1024 tokens (Zipf 1.1) + 256 "
            "unique tokens, 240 requests"
        )
        print(f"  {'local tier':>10s} {'hit ratio':>10s} {'served locally':>15s} {'mean lookup ms':>15s}")
        for mb in (0, 8, 64):
            r = local_tier_workload(redis_srv.url, bench_layout, mb)
            print(f"  {f'{mb} MiB':>10s} {r['hit_ratio']:10.3f} {r['local_ratio']:15.3f} {r['lookup_ms']:15.2f}")
        if args.quality:
            quality(work)
    finally:
        redis_srv.stop()

    if args.json:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
        date = subprocess.run(["date", "-u", "+%Y-%m-%dT%H:%M:%SZ"], capture_output=True, text=True).stdout.strip()
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "ttft_ms_cold": round(t["cold"][0], 1),
                    "ttft_ms_50pct": round(t["50pct"][0], 1),
                    "ttft_ms_90pct": round(t["90pct"][0], 1),
                    "lookup_ms_4k": round(look, 2),
                    "bytes_per_token": round(bpt, 1),
                    "date": date,
                    "commit": commit,
                    "machine": machine(),
                },
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
