"""Where a prompt-cache hit's engine step goes, in one process (issue 11's local-tier row): a 4096-token prompt of the
8B shape on the prefill service's engine (bf16 pool, int8 pages shipped and cached), first cold, then with its first
230 pages (3680 tokens) imported from int8 payloads as a local-tier hit hands them over. Prints the wall ms of each
and the CUDA time per kernel of the hit's step (torch.profiler), so the served hit's ~46 ms chunk step can be split
into import (host stack, host -> device copy, dequantize + scatter) and the 416-token forward.

    python bench/cache_import.py [--model-dir /dev/shm/llama3-8b-random]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_engine as ge

from pdserve.engine.sampling import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prefill(e, rid: str, prompt: list[int], cached=None, export: bool = False) -> tuple[float, list]:
    """Wall ms of a prefill-only request to its first token (GPU synchronised), and its pages as int8 payloads."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    e.add_request(rid, prompt, ONE, prefill_only=True, cached_pages=cached)
    pages, done = [], False
    while not done:
        for o in e.step():
            if export:
                pages += e.export_pages(rid, o.ready_pages, "int8", 64, False)
            done = done or o.finished
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    e.release(rid)
    return ms, pages


def pages_of(e, prompt: list[int]) -> list:
    return prefill(e, "u", prompt, export=True)[1]


def _memmove_into(dst: torch.Tensor, srcs: list[torch.Tensor]) -> None:
    import ctypes

    n = srcs[0].nbytes
    for i, t in enumerate(srcs):
        ctypes.memmove(dst.data_ptr() + i * n, t.data_ptr(), n)


def upload_side_by_side(pages: list, reps: int = 7) -> None:
    """The import's host -> device upload of the 230 pages' int8 data alone: the engine's torch.stack into pinned
    memory + one copy, against a 4-thread memmove into pinned memory in 16 MB groups, each group's copy queued as
    soon as it is in (the threaded version tried in f55add0, reverted: it did not move the served hit)."""
    from concurrent.futures import ThreadPoolExecutor

    ts = [p.data for p in pages]
    dev = torch.device("cuda")

    def stacked():
        host = torch.empty((len(ts), *ts[0].shape), dtype=ts[0].dtype, pin_memory=True)
        torch.stack(ts, out=host)
        return host.to(dev, non_blocking=True)

    pool = ThreadPoolExecutor(4)

    def threaded():
        host = torch.empty((len(ts), *ts[0].shape), dtype=ts[0].dtype, pin_memory=True)
        out = torch.empty(host.shape, dtype=host.dtype, device=dev)
        per = max(1, (16 << 20) // ts[0].nbytes)
        spans = [(a, min(a + per, len(ts))) for a in range(0, len(ts), per)]
        jobs = [pool.submit(_memmove_into, host[a:b], ts[a:b]) for a, b in spans]
        for (a, b), j in zip(spans, jobs):
            j.result()
            out[a:b].copy_(host[a:b], non_blocking=True)
        return out

    res: dict[str, list[tuple[float, float]]] = {"stack": [], "threaded": []}
    for _ in range(reps):
        for name, fn in (("stack", stacked), ("threaded", threaded)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            res[name].append(((t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
    nbytes = sum(t.nbytes for t in ts)
    for name, xs in res.items():
        host_ms = statistics.median(x[0] for x in xs[1:])
        all_ms = statistics.median(x[1] for x in xs[1:])
        ge.row(f"upload of {nbytes / 1e6:.0f} MB, {name} (host / to done, ms)", f"{host_ms:.1f} / {all_ms:.1f}")
    pool.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="/dev/shm/llama3-8b-random")
    args = ap.parse_args()
    ge.write_checkpoint(Path(args.model_dir), 32)
    e = ge.make_engine(Path(args.model_dir), "auto", num_pages=4096)  # the prefill service's pool: bf16
    g = torch.Generator().manual_seed(21)
    fresh = lambda n: torch.randint(5, ge.SHAPE["vocab_size"], (n,), generator=g).tolist()
    cold, hit = [], []
    for r in range(4):
        prompt = fresh(4096)
        ms, pages = prefill(e, f"c{r}", prompt, export=True)
        cold.append(ms)
        cached = pages[:230]  # the 3680-token prefix, as the cache holds it (int8, CPU)
        hit.append(prefill(e, f"h{r}", prompt, cached=cached)[0])
    ge.row("engine prefill 4k cold (ms)", f"{statistics.median(cold[1:]):.1f}", f"all {[round(x, 1) for x in cold]}")
    ge.row(
        "engine prefill 4k, 3680 cached (ms)", f"{statistics.median(hit[1:]):.1f}", f"all {[round(x, 1) for x in hit]}"
    )
    upload_side_by_side(pages_of(e, fresh(4096))[:230])
    from torch.profiler import ProfilerActivity, profile

    prompt = fresh(4096)
    _, pages = prefill(e, "p", prompt, export=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(e, "q", prompt, cached=pages[:230])
    events = sorted(prof.key_averages(), key=lambda x: -x.device_time_total)[:14]
    print("CUDA time of the hit's request, top kernels (ms):")
    for ev in events:
        print(f"  {ev.device_time_total / 1e3:8.2f}  x{ev.count:<5d} {ev.key[:100]}")
    cpu = sorted(prof.key_averages(), key=lambda x: -x.cpu_time_total)[:10]
    print("CPU time (ms):")
    for ev in cpu:
        print(f"  {ev.cpu_time_total / 1e3:8.2f}  x{ev.count:<5d} {ev.key[:100]}")
    ge.print_rows()


if __name__ == "__main__":
    sys.exit(main())
