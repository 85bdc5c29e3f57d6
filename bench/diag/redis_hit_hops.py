"""Where a Redis prefix hit's first token goes, step by step, beside a cold prompt of the same length: `pdserve up`'s
stack (router, prefill, decode; the prompt cache on a redis-server this script starts, Redis only: no local tier, no
pool reuse) of a tiny random Llama on this host's CPU (or `--model` on `--gpus`), every service exporting its spans
to an OTLP sink in its own process. Cold prompts of `--prompt` tokens one at a time, then one prefix of
`--cached-share` of them written once (by this prefill: a hit reads it back from Redis, as one written by another
instance) and hit `--hits` times with fresh tails, as `bench/one_gpu.py --part cache` does.

    python bench/diag/redis_hit_hops.py [--prompt 4096] [--model DIR --gpus 0] [--json OUT]

For each request: its TTFT, the prompt tokens the cache gave, where the racing fetch started and what it loaded
(prefill.request's `pdserve.cache.fetch_*`), and each prefill chunk's tokens, start (ms from the router's span),
the host time until its forward was queued (`launched`) and its duration to its outputs; the gaps between chunks are
the engine thread's time between steps (loading landed pages, gathering pages for the write-back). Figures:
docs/benchmarks.md, "One GPU"."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchutil import model_or_tiny, token_times_ms
from gpu_serving import REDIS_ONLY, SinkProcess, fresh

FETCH_KEYS = (
    "fetch_start_page",
    "fetch_pages_fetched",
    "fetch_pages_loaded",
    "fetch_wait_ms",
    "fetch_landed_ms",
    "fetch_split_gbps",
    "fetch_batches_landed_ms",
)


def _plain(v):
    """An attribute as JSON takes it (a sequence attribute comes back as a tuple)."""
    return list(v) if isinstance(v, tuple) else v


def timeline(spans: list) -> dict:
    """One request's figures from its spans (the sink held only its trace)."""
    router = min((s for s in spans if s.name == "router.generate"), key=lambda s: s.start_ns)
    at = lambda ns: round((ns - router.start_ns) / 1e6, 2)
    request = next((s for s in spans if s.name == "prefill.request"), None)
    attrs = request.attributes if request is not None else {}
    chunks = sorted((s for s in spans if s.name == "prefill.chunk"), key=lambda s: s.start_ns)
    return {
        "prefill_start_ms": at(request.start_ns) if request is not None else None,
        "cached_tokens": attrs.get("pdserve.cached_tokens"),
        **{k: _plain(attrs.get(f"pdserve.cache.{k}")) for k in FETCH_KEYS},
        "chunks": [
            {
                "tokens": [c.attributes["pdserve.chunk.start"], c.attributes["pdserve.chunk.end"]],
                "start_ms": at(c.start_ns),
                "launched_ms": c.attributes.get("pdserve.chunk.launched_ms"),
                "forward_ms": c.attributes.get("pdserve.chunk.forward_ms"),
                "forward_cpu_ms": c.attributes.get("pdserve.chunk.forward_cpu_ms"),
                "layer_export_ms": c.attributes.get("pdserve.chunk.layer_export_ms"),
                "dur_ms": round((c.end_ns - c.start_ns) / 1e6, 2),
            }
            for c in chunks
        ],
    }


def each_span(spans: list) -> None:
    """Every span of one request, in start order: service/name, start (ms from the router's span), duration, and
    where its first token went out."""
    router = min((s for s in spans if s.name == "router.generate"), key=lambda s: s.start_ns)
    for s in sorted(spans, key=lambda s: s.start_ns):
        first = next((a["pdserve.ttft_ms"] for n, a in s.events if n == "first_token"), None)
        print(
            f"      {s.service}/{s.name:<28} {(s.start_ns - router.start_ns) / 1e6:9.2f} ms  "
            f"{(s.end_ns - s.start_ns) / 1e6:9.2f} ms" + (f"  first token at +{first:.2f}" if first else "")
        )


def show(label: str, ttft: float, t: dict) -> None:
    fetch = " ".join(f"{k.removeprefix('fetch_')}={t[k]}" for k in FETCH_KEYS if t.get(k) is not None)
    print(f"{label}: TTFT {ttft:.1f} ms, cached {t['cached_tokens']}, prefill at +{t['prefill_start_ms']} ms {fetch}")
    for c in t["chunks"]:
        a, b = c["tokens"]
        line = f"    chunk [{a:>5}, {b:>5})  start +{c['start_ms']:8.2f}  launched {c['launched_ms']}"
        line += f" (forward {c.get('forward_ms')}, its CPU {c.get('forward_cpu_ms')}"
        line += f", exports {c.get('layer_export_ms')})"
        print(f"{line}  dur {c['dur_ms']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a model directory (default: a tiny random Llama, written here)")
    ap.add_argument("--gpus", default="", help="comma-separated GPU indices for the engines (`pdserve up --gpus`)")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens (cold and hit)")
    ap.add_argument("--cached-share", type=float, default=0.9, help="the share of the prompt the prefix holds")
    ap.add_argument("--cold", type=int, default=3, help="cold requests (after one warm-up)")
    ap.add_argument("--hits", type=int, default=6)
    ap.add_argument(
        "--redis-shards",
        type=int,
        default=1,
        help="1: one redis-server; N: a Redis Cluster of N shards on this host (as bench/one_gpu.py --redis-shards)",
    )
    ap.add_argument("--fetch-process", default="auto", help="the prefill's --cache-fetch-process")
    ap.add_argument(
        "--prefill-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also set this in the stack's environment (repeatable), e.g. PDSERVE_PREFILL_CACHE_FETCH_BATCH_PAGES=16",
    )
    ap.add_argument("--json", default="", help="also write every request's figures here")
    ap.add_argument("--each", action="store_true", help="also every span of each request")
    args = ap.parse_args()
    from pdserve.cli.launch import start_stack
    from pdserve.testing.redis_server import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="redis-hops-"))
    model, vocab = model_or_tiny(args.model, tmp)
    rng = torch.Generator().manual_seed(0)
    gpus = [int(g) for g in args.gpus.split(",") if g]
    if args.redis_shards > 1:
        from pdserve.testing.redis_cluster import RedisClusterServers

        redis = RedisClusterServers(tmp / "redis-cluster", shards=args.redis_shards).start()
    else:
        redis = RedisServer(tmp / "redis").start()
    sink = SinkProcess().start()
    env = {"REDIS_URL": redis.url, **REDIS_ONLY, "PDSERVE_PREFILL_CACHE_FETCH_PROCESS": args.fetch_process,
           "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip
    if args.redis_shards > 1:
        env["PDSERVE_PREFILL_REDIS_CLUSTER"] = "true"
    env.update(kv.split("=", 1) for kv in args.prefill_env)
    extra = [] if gpus else ["--torch-threads", "1"]
    stack = start_stack(model, tmp / "stack", kv_dtype="int8", extra=extra, env=env, gpus=gpus)
    out: dict[str, list] = {"cold": [], "hit": []}
    try:
        import pdserve

        with pdserve.Client(stack.router, timeout=120) as c:

            def traced(ids: list[int]) -> tuple[float, dict]:
                sink.clear()
                t0 = time.time()
                (ttft, *_), _ = token_times_ms(c, ids)
                t1 = time.time()
                time.sleep(0.6)  # the services' span processors export every 100 ms
                spans = sink.spans()
                if args.each:
                    each_span(spans)
                return ttft, {"wall_s": [t0, t1], **timeline(spans)}  # epoch seconds: to line up a profile

            traced(fresh(args.prompt, rng, vocab))  # warm-up
            for i in range(args.cold):
                ttft, t = traced(fresh(args.prompt, rng, vocab))
                show(f"cold {i}", ttft, t)
                out["cold"].append({"ttft_ms": ttft, **t})
            n = int(args.prompt * args.cached_share)
            prefix = fresh(n, rng, vocab)
            token_times_ms(c, prefix + fresh(args.prompt - n, rng, vocab))  # writes the prefix's pages to Redis
            time.sleep(1.5)  # the write-back runs behind the engine
            for i in range(args.hits):
                ttft, t = traced(prefix + fresh(args.prompt - n, rng, vocab))
                show(f"hit {i}", ttft, t)
                out["hit"].append({"ttft_ms": ttft, **t})
    finally:
        stack.stop()
        sink.stop()
        redis.stop()
    cold = [r["ttft_ms"] for r in out["cold"]]
    hits = [r["ttft_ms"] for r in out["hit"]]
    print(f"TTFT cold median {statistics.median(cold):.1f} ms; hit first {hits[0]:.1f}, median of the rest "
          f"{statistics.median(hits[1:] or hits):.1f} ms")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
