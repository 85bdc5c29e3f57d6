"""What a racing prefix fetch costs the engine beside it: a 2048-token prefill of the 8B shape (random bf16 weights,
int8 KV, 32 layers unless --layers) timed alone and with a fetch of a 4k prompt's 90% (230 int8 pages, ~249 MB)
from Redis started just before it, in the same process, for each way of fetching:

    python bench/fetch_beside_prefill.py [--redis-shards 4] [--reps 5] [--connections 8,16]
        [--switch-interval-us 5000,200] [--fa3-call direct,interface] [--ways none,helper-c8] [--profile]

- none: the prefill alone;
- helper-cN / threads: the fetch's reads and MAC checks in the helper process (`--cache-fetch-process on`, the GPU
  default) over N connections (each --connections entry), or on 8 threads of this process, copies to the GPU
  included (what a prefill instance does);
- helper-host: the helper (8 connections), no copies to the GPU (isolates the copies' share).

Each way once per `--fa3-call` entry (how the engine calls FA3, pdserve.engine.fa3_call) and
`--switch-interval-us` entry (the process's GIL switch interval, pdserve.server.gil; an engine
service's `--gil-switch-interval-us`). Prints, per way: the prefill's median ms and its ratio to alone (at the same
interval), the fetch's own time to its last page and its GB/s (the fetch runs beside the prefill, so this is its
served rate). CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchutil import log, submit
from gpu_engine import make_engine, write_checkpoint
from prompt_cache import KEYRING, LAYOUT_8B, PAGE, filled_cache, rand_tokens

from pdserve.cache.prefix_fetch import PrefixFetch
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.redis_store import RedisStore
from pdserve.engine.fa3_call import FA3Forward
from pdserve.engine.sampling import SamplingParams
from pdserve.server.gil import set_switch_interval


def prefill_ms(engine, prompt: list[int], rid: str) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    submit(engine, rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def profiled(run, what: str) -> None:
    """`run()` under torch.profiler: its wall ms, the GPU's busy ms (the union of its kernels' intervals) and the
    CPU ops with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms = run()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy, cur = 0.0, None
    for a, b in spans:
        if cur is None or a > cur[1]:
            busy += (cur[1] - cur[0]) if cur else 0.0
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    busy += (cur[1] - cur[0]) if cur else 0.0
    print(f"== profile {what}: wall {ms:.1f} ms (profiled), GPU busy {busy / 1e3:.1f} ms, {len(spans)} GPU events")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--redis-shards", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--connections", default="8", help="the helper's connections, one run per entry")
    ap.add_argument("--switch-interval-us", default="0", help="GIL switch intervals, one pass of every way each")
    ap.add_argument("--fa3-call", default="direct", help="how FA3 is called, one pass of every way each: direct (the "
                    "op, pdserve.engine.fa3_call) and/or interface (flash_attn_interface's functions)")  # fmt: skip
    ap.add_argument("--ways", default="", help="only these ways (comma-separated; default: all)")
    ap.add_argument("--profile", action="store_true", help="per way one more run under torch.profiler: the GPU's busy "
                    "ms (kernels' union) and the CPU ops of most self time")  # fmt: skip
    ap.add_argument("--model-dir", default="", help="the random checkpoint here (written if absent; reused after)")
    args = ap.parse_args()
    from pdserve.testing.redis_cluster import RedisClusterServers
    from pdserve.testing.redis_server import RedisServer

    work = Path(tempfile.mkdtemp(prefix="pdserve-beside-"))
    model = Path(args.model_dir) if args.model_dir else work / "model"
    if not (model / "config.json").exists():
        write_checkpoint(model, args.layers)
    engine = make_engine(model, "int8", num_pages=4096)
    cluster = args.redis_shards > 1
    redis = (RedisClusterServers(work / "rc", shards=args.redis_shards) if cluster else RedisServer(work / "r")).start()
    caches: dict[str, PromptCache] = {}
    try:
        tokens = rand_tokens(3681, 4242)
        pages = 3680 // PAGE
        caches["threads"], ns = filled_cache(redis.url, tokens, layout=LAYOUT_8B, cluster=cluster, fetch_connections=8)
        helpers = [(f"helper-c{n}", int(n), True) for n in args.connections.split(",")] + [("helper-host", 8, False)]
        for way, n, pin in helpers:
            store = RedisStore(redis.url, cluster=cluster, timeout_s=10.0)
            caches[way] = PromptCache(store, keyring=KEYRING, fetch_connections=n)
            assert caches[way].use_fetch_process(1 << 30, pin=pin)
        keys = ns.page_keys(tokens)
        g = torch.Generator().manual_seed(1)
        head = f"{'FA3':<9} {'GIL us':>6} {'way':<12} {'prefill ms':>10} {'x alone':>8} {'fetch ms':>9}"
        rows = [f"{head} {'fetch GB/s':>10}"]
        alone = None
        passes = [(fa, float(us), way) for fa in args.fa3_call.split(",") for us in args.switch_interval_us.split(",")
                  for way in ["none", "threads", *(w for w, _, _ in helpers)]
                  if not args.ways or way in args.ways.split(",")]  # fmt: skip
        backend = engine.runner.backend
        for fa, us, way in passes:
            set_switch_interval(us)
            if backend.name == "fa3":
                backend.fa = FA3Forward(backend.fa.module, direct=fa == "direct")
            times, fetch_s, gbps = [], [], []
            for r in range(args.reps + 1 + args.profile):
                prompt = torch.randint(100, 30000, (args.prompt_tokens,), generator=g).tolist()
                fetch = None
                if way != "none":
                    device = "cpu" if way == "helper-host" else "cuda:0"
                    fetch = PrefixFetch(caches[way], ns, keys, 0, pages, device=device, batch_pages=8).start()
                if r == args.reps + 1:  # the profiled run (--profile)
                    profiled(lambda: prefill_ms(engine, prompt, f"{way}-{r}"), f"{way} at {us:g} us, FA3 {fa}")
                    if fetch is not None:
                        fetch.wait(pages, 60)
                        fetch.close()
                    continue
                ms = prefill_ms(engine, prompt, f"{way}-{r}")
                if fetch is not None:
                    assert fetch.wait(pages, 60) == pages
                    if r:
                        fetch_s.append(fetch.landed_s)
                        gbps.append(fetch.landed_bytes / fetch.landed_s / 1e9)
                    fetch.close()
                if r:  # the first run warms up
                    times.append(ms)
            med = statistics.median(times)
            alone = med if way == "none" else alone
            fetch_ms = f"{statistics.median(fetch_s) * 1e3:.1f}" if fetch_s else "-"
            rate = f"{statistics.median(gbps):.2f}" if gbps else "-"
            rows.append(f"{fa:<9} {us:>6g} {way:<12} {med:>10.1f} {med / alone:>8.2f} {fetch_ms:>9} {rate:>10}")
            log(f"{way} at {us:g} us, FA3 {fa}: prefill runs {', '.join(f'{t:.1f}' for t in times)} ms")
        print("\n".join(rows))
    finally:
        for c in caches.values():
            c.close()
        redis.stop()


if __name__ == "__main__":
    main()
