"""The grpc-shm shippers alone: a prefill-side and a decode-side shipper process (`pdserve.kv.shipper`) on this host,
`--batches` blocks of `--batch-mb` pushed one after another through their arenas (each given back as decode takes
it, as the acks do), no engine and no KV checks: the pair's own rate and CPU per GB (docs/benchmarks.md, "KV
transfer paths").

    python bench/diag/shipper_pair.py [--batches 64] [--batch-mb 8] [--arena-mb 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(n: int, size: int, arena: int) -> tuple[float, float, float]:
    """(GB/s, prefill shipper CPU s/GB, decode shipper CPU s/GB)"""
    from pdserve.kv.shipper.link import ShipperLink

    pre = ShipperLink("prefill", arena, pin=False).start()
    dec = ShipperLink("decode", arena, pin=False).start()
    try:
        assert pre.pid is not None and dec.pid is not None
        key = os.urandom(16)
        inbox = dec.inbox(key)
        landed = threading.Semaphore(0)
        blocks: dict = {}

        def taker(seq: int):
            def take() -> None:
                dec.release(inbox.take(seq))
                pre.give(blocks.pop(seq))
                landed.release()

            return take

        c0 = cpu_s(pre.pid), cpu_s(dec.pid)
        t0 = time.perf_counter()
        for seq in range(n):
            blocks[seq] = block = pre.reserve(size, 60)
            inbox.when(seq, taker(seq))
            pre.push(dec.address("127.0.0.1"), key, seq, block, size)
        for _ in range(n):
            landed.acquire()
        dt = time.perf_counter() - t0
        gb = n * size / 1e9
        return gb / dt, (cpu_s(pre.pid) - c0[0]) / gb, (cpu_s(dec.pid) - c0[1]) / gb
    finally:
        pre.close()
        dec.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=64)
    ap.add_argument("--batch-mb", type=float, default=8.0)
    ap.add_argument("--arena-mb", type=float, default=256.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    runs = [one_run(args.batches, int(args.batch_mb * 2**20), int(args.arena_mb * 2**20)) for _ in range(args.reps)]
    for gbps, pre, dec in runs:
        print(f"{gbps:.2f} GB/s; CPU s per GB: prefill's shipper {pre:.2f}, decode's {dec:.2f}")
    print(f"median {statistics.median(r[0] for r in runs):.2f} GB/s over {args.reps} runs")


if __name__ == "__main__":
    main()
