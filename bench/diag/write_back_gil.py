"""What a prompt-cache write-back costs the threads beside it: a 2k prompt's int8 pages of the 8B shape (128 pages,
~138 MB) written through `serving.write_back` and the prompt cache's store writer to a real Redis, while two probes
of the same process measure the GIL's share:

- hop: one thread hands a timestamp to another through a `queue.Queue` (a gRPC handler waking the engine thread or
  a stream writer), and the receiver records how long it took to run;
- work: a `PrefillStart` of 2048 token ids serialised and parsed (a request's first Python work at a hop).

    python bench/diag/write_back_gil.py [--redis redis://127.0.0.1:6379/0] [--rounds 3] [--pages 128]

Prints per phase (alone, during the write-back's encode, during the store writer's sends) the probes' median and
p90 in microseconds, and the write-back's own times. Figures: docs/benchmarks.md, "One GPU"."""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time

import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.prompt_cache import PromptCache
from pdserve.cache.redis_store import RedisStore
from pdserve.cache.serving import write_back
from pdserve.cache.store import MemoryStore
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer import ExportedPages
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.v1 import internal_pb2

LAYOUT = KVLayoutSpec("int8", page_size=16, num_layers=32, num_kv_heads=8, head_dim=128, group_size=64)


class Probes:
    """Both probes on their own threads until `stop`; each sample is (perf_counter at its start, microseconds)."""

    def __init__(self, period_s: float = 0.001):
        self.period_s = period_s
        self.hops: list[tuple[float, float]] = []
        self.work: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._q: queue.Queue[float | None] = queue.Queue()
        start = internal_pb2.PrefillStart(request_id="r" * 32, prompt_token_ids=range(5, 2053), start_key=b"k" * 16)
        self._payload = start.SerializeToString()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._send, self._receive, self._parse)]

    def start(self) -> Probes:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._q.put(None)
        for t in self._threads:
            t.join()

    def _send(self) -> None:
        while not self._stop.is_set():
            self._q.put(time.perf_counter())
            time.sleep(self.period_s)

    def _receive(self) -> None:
        while (sent := self._q.get()) is not None:
            self.hops.append((sent, (time.perf_counter() - sent) * 1e6))

    def _parse(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            msg = internal_pb2.PrefillStart.FromString(self._payload)
            msg.SerializeToString()
            self.work.append((t0, (time.perf_counter() - t0) * 1e6))
            time.sleep(self.period_s)


def stats(samples: list[tuple[float, float]], t0: float, t1: float) -> str:
    us = sorted(v for t, v in samples if t0 <= t < t1)
    if not us:
        return "       -        -     0"
    return f"{statistics.median(us):8.0f} {us[int(0.9 * (len(us) - 1))]:8.0f} {len(us):5d}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--redis",
        default="redis://127.0.0.1:6379/0",
        help="the store; memory: the in-process one of `pdserve up` without a Redis URL (its default size)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pages", type=int, default=128, help="pages of the prompt (16 tokens each)")
    ap.add_argument("--local-mb", type=float, default=0.0, help="the cache's local tier (0: off)")
    args = ap.parse_args()
    store = MemoryStore(1 << 30) if args.redis == "memory" else RedisStore(args.redis)
    cache = PromptCache(store, local_bytes=int(args.local_mb * (1 << 20)))
    rows = torch.randint(0, 256, (args.pages, PageFormat(LAYOUT).page_bytes), dtype=torch.uint8)
    print(f"{args.pages} pages of {PageFormat(LAYOUT).page_bytes} bytes ({rows.numel() / 1e6:.0f} MB), {args.redis}")
    print(f"{'phase':<28} {'hop p50':>8} {'p90':>8} {'n':>5}   {'work p50':>8} {'p90':>8} {'n':>5}")
    for r in range(args.rounds):
        ns = CacheNamespace(f"write-back-gil-{time.time_ns()}-{r}", LAYOUT)  # fresh keys: every page is written
        prompt = list(range(1000, 1000 + args.pages * LAYOUT.page_size))
        keys = ns.page_keys(prompt)
        batch = ExportedPages(list(range(args.pages)), [LAYOUT.page_size] * args.pages, rows)
        probes = Probes().start()
        time.sleep(0.3)
        t_alone = time.perf_counter()
        time.sleep(0.5)
        t_encode = time.perf_counter()
        written = write_back(cache, ns, keys, range(args.pages), [], [batch], LAYOUT)
        t_send = time.perf_counter()
        cache.flush(60.0)
        t_done = time.perf_counter()
        time.sleep(0.2)
        probes.stop()
        phases = [("alone", t_alone, t_encode), (f"encode ({(t_send - t_encode) * 1e3:.0f} ms)", t_encode, t_send),
                  (f"store writes ({(t_done - t_send) * 1e3:.0f} ms)", t_send, t_done)]  # fmt: skip
        for name, a, b in phases:
            print(f"{name:<28} {stats(probes.hops, a, b)}   {stats(probes.work, a, b)}")
        print(f"  round {r}: {written} pages written")
    cache.close()


if __name__ == "__main__":
    main()
