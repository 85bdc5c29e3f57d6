"""The grpc-shm shippers alone: `--shippers N` prefill-side and N decode-side shipper processes (`pdserve.kv.shipper`,
a `ShipperGroup` on each end, as `--kv-shippers`) on this host, `--batches` blocks of `--batch-mb` pushed one after
another through their arenas (spread over the shippers; each given back as decode takes it, as the acks do), no
engine and no KV checks: the pairs' own rate and CPU per GB (docs/benchmarks.md, "KV transfer paths"). Compare
N = 1, 2, 4: one pair is bound by Python gRPC's copies in each shipper process.

    python bench/diag/shipper_pair.py [--shippers 1] [--batches 64] [--batch-mb 8] [--arena-mb 256] [--reps 3]
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


def group_cpu_s(pids: list[int]) -> float:
    return sum(cpu_s(pid) for pid in pids)


def one_run(n: int, size: int, arena: int, shippers: int) -> tuple[float, float, float]:
    """(GB/s, prefill shippers' CPU s/GB, decode shippers' CPU s/GB); `arena`: each end's total, split over its
    shippers (as --kv-shipper-arena-mb)."""
    from pdserve.kv.shipper.group import ShipperGroup

    pre = ShipperGroup.of("prefill", shippers, arena, pin=False).start()
    dec = ShipperGroup.of("decode", shippers, arena, pin=False).start()
    try:
        pre_pids, dec_pids = [p for p in pre.pids if p is not None], [p for p in dec.pids if p is not None]
        assert len(pre_pids) == len(dec_pids) == shippers, "a shipper did not start"
        addresses = dec.addresses("127.0.0.1")
        key = os.urandom(16)
        inbox = dec.inbox(key)
        landed = threading.Semaphore(0)
        blocks: dict = {}

        def taker(seq: int):
            def take() -> None:
                inbox.release(inbox.take(seq))
                pre.give(blocks.pop(seq))
                landed.release()

            return take

        c0 = group_cpu_s(pre_pids), group_cpu_s(dec_pids)
        t0 = time.perf_counter()
        for seq in range(n):
            blocks[seq] = block = pre.reserve(size, 60)
            inbox.when(seq, taker(seq))
            pre.push(addresses, key, seq, block, size)
        for _ in range(n):
            landed.acquire()
        dt = time.perf_counter() - t0
        gb = n * size / 1e9
        return gb / dt, (group_cpu_s(pre_pids) - c0[0]) / gb, (group_cpu_s(dec_pids) - c0[1]) / gb
    finally:
        pre.close()
        dec.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shippers", type=int, default=1, help="shipper processes on each end (as --kv-shippers)")
    ap.add_argument("--batches", type=int, default=64)
    ap.add_argument("--batch-mb", type=float, default=8.0)
    ap.add_argument("--arena-mb", type=float, default=256.0, help="each end's arena, all its shippers together")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    size, arena = int(args.batch_mb * 2**20), int(args.arena_mb * 2**20)
    if 2 * size > arena // args.shippers:
        raise SystemExit("--arena-mb / --shippers must hold two batches of --batch-mb")
    runs = [one_run(args.batches, size, arena, args.shippers) for _ in range(args.reps)]
    for gbps, pre, dec in runs:
        print(f"{gbps:.2f} GB/s; CPU s per GB: prefill's shippers {pre:.2f}, decode's {dec:.2f}")
    print(f"median {statistics.median(r[0] for r in runs):.2f} GB/s over {args.reps} runs, {args.shippers} pair(s)")


if __name__ == "__main__":
    main()
