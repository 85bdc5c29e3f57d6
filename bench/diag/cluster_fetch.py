"""How fast the prompt cache's store reads megabyte values from a Redis Cluster on this host: `RedisStore.
get_many_into` (the prefix fetch's read, `resp_fetch`) of batches of 1 MiB values spread over the shards, from one
or several threads at once, straight into a buffer (no MAC or value checks: the store's read alone).

    python bench/diag/cluster_fetch.py [--shards 4] [--batch 8] [--threads 1,4] [--reps 40]

Prints per thread count the median GB/s over the repetitions. Figures: docs/benchmarks.md, "Prompt cache"."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.cache.redis_store import RedisStore
from pdserve.testing.redis_cluster import RedisClusterServers

VALUE = 1 << 20
KEYS = 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="values a call reads (the prefix fetch's batch_pages)")
    ap.add_argument("--threads", default="1,4", help="threads reading at once, one row per entry")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    cluster = RedisClusterServers(Path(tempfile.mkdtemp(prefix="cluster-fetch-")), shards=args.shards).start()
    try:
        store = RedisStore(cluster.url, cluster=True, timeout_s=10.0)
        value = os.urandom(VALUE)
        keys = [f"cluster-fetch:{i}".encode() for i in range(KEYS)]
        for i in range(0, KEYS, 16):
            store.set_many([(k, value) for k in keys[i : i + 16]], 600_000)
        print(f"{'threads':>7} {'batch':>5} {'GB/s':>6}  ({args.shards} shards, {VALUE >> 20} MiB values)")
        for threads in (int(t) for t in args.threads.split(",")):
            bufs = [memoryview(bytearray(args.batch * VALUE)) for _ in range(threads)]

            def read(t: int, first: int) -> None:
                batch = [keys[(first + j) % KEYS] for j in range(args.batch)]
                lens = store.get_many_into(batch, 600_000, lambda i, n: bufs[t][i * VALUE : (i + 1) * VALUE], 2 * VALUE)
                assert lens == [VALUE] * args.batch, lens

            rates = []
            with ThreadPoolExecutor(threads) as pool:
                for rep in range(args.reps):
                    t0 = time.perf_counter()
                    for f in [pool.submit(read, t, (rep * threads + t) * args.batch) for t in range(threads)]:
                        f.result()
                    rates.append(threads * args.batch * VALUE / (time.perf_counter() - t0) / 1e9)
            print(f"{threads:>7} {args.batch:>5} {statistics.median(rates):>6.2f}")
        store.close()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
