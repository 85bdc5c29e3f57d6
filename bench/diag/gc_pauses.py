"""Garbage-collection pauses of a served stack, with the start-up heap frozen (`--gc-freeze`, the default) and not,
side by side: `pdserve up`'s stack (router, prefill, decode) of a tiny random Llama on this host's CPU (or `--model`
on `--gpus`), `--requests` prompts of `--prompt` tokens through it `--concurrency` at a time, then each service's
`pdserve_gc_pause_seconds` scraped from /metrics: per generation the collections, their total and the longest's
bucket; and the requests' TTFT p50 / p99.

    python bench/diag/gc_pauses.py [--requests 200] [--prompt 512] [--model DIR --gpus 0]

Figures: docs/benchmarks.md ("Garbage collection")."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchutil import model_or_tiny, token_times_ms
from gpu_serving import fresh


def pauses(address: str) -> dict[str, tuple[int, float, float]]:
    """generation -> (collections, total s, upper bound of the longest's bucket)"""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != "pdserve_gc_pause_seconds":
            continue
        for s in fam.samples:
            g = s.labels.get("generation")
            row = out.setdefault(g, [0, 0.0, 0.0, []])
            if s.name.endswith("_count"):
                row[0] = int(s.value)
            elif s.name.endswith("_sum"):
                row[1] = s.value
            elif s.name.endswith("_bucket"):
                row[3].append((float(s.labels["le"]), s.value))
    result = {}
    for g, (n, total, _, buckets) in out.items():
        buckets.sort()
        longest = next((le for le, c in buckets if c >= n), float("inf")) if n else 0.0
        result[g] = (n, total, longest)
    return result


def run(args, model: Path, freeze: bool, gpus: list[int], tmp: Path, rng: torch.Generator, vocab: int) -> None:
    import pdserve
    from pdserve.cli.launch import start_stack

    env = {f"PDSERVE_{svc}_GC_FREEZE": str(freeze).lower() for svc in ("ROUTER", "PREFILL", "DECODE")}
    extra = [] if gpus else ["--torch-threads", "1"]
    stack = start_stack(model, tmp / f"stack-{freeze}", kv_dtype="int8", extra=extra, env=env, gpus=gpus)
    ttfts: list[float] = []
    lock = threading.Lock()
    try:
        prompts = [fresh(args.prompt, rng, vocab) for _ in range(args.requests)]

        def worker(k: int) -> None:
            with pdserve.Client(stack.router, timeout=120) as c:
                for ids in prompts[k :: args.concurrency]:
                    (ttft, *_), _ = token_times_ms(c, ids, max_tokens=args.max_tokens)
                    with lock:
                        ttfts.append(ttft)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - t0
        services = {"router": stack.router, **{f"prefill{i}": a for i, a in enumerate(stack.prefill)},
                    **{f"decode{i}": a for i, a in enumerate(stack.decode)}}  # fmt: skip
        ttfts.sort()
        p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        print(f"--gc-freeze {str(freeze).lower()}: {len(ttfts)} requests in {took:.1f} s, TTFT p50 "
              f"{statistics.median(ttfts):.1f} ms, p99 {p99:.1f} ms")  # fmt: skip
        for name, addr in services.items():
            got = pauses(addr.metrics)
            cells = [f"gen {g}: {n} x, {total * 1e3:.1f} ms in all, longest <= {longest * 1e3:g} ms"
                     for g, (n, total, longest) in sorted(got.items())]  # fmt: skip
            print(f"  {name:9s} " + "; ".join(cells))
    finally:
        stack.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a model directory (default: a tiny random Llama, written here)")
    ap.add_argument("--gpus", default="", help="comma-separated GPU indices for the engines")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--freeze", default="true,false", help="the --gc-freeze settings to run, in order")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gc-pauses-"))
    model, vocab = model_or_tiny(args.model, tmp)
    gpus = [int(g) for g in args.gpus.split(",") if g]
    for setting in args.freeze.split(","):
        run(args, model, setting == "true", gpus, tmp, torch.Generator().manual_seed(0), vocab)


if __name__ == "__main__":
    main()
