"""The GIL convoy: a loop of torch ops (the engine thread launching a prefill chunk) timed alone and beside one
thread of the same process that runs Python (parsing KV messages, as a gRPC handler does), at each switch interval:

    python bench/diag/gil_convoy.py [--device cuda:0] [--ops 2000] [--intervals-us 5000,1000,200,50]

Every torch op releases the GIL and takes it back; with a Python thread running beside, taking it back waits for
the switch interval (pdserve.server.gil). Prints per interval the loop's ms alone and beside, their ratio, and the
busy thread's messages parsed per second (what the shorter interval costs it)."""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

from pdserve.v1 import kv_pb2


def op_loop(x: torch.Tensor, ops: int) -> float:
    """ms for `ops` small in-place ops on x's device (launch-bound on a GPU), synchronized at the end."""
    t0 = time.perf_counter()
    for _ in range(ops):
        x.mul_(1.0001)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def busy(stop: threading.Event, counts: list[int]) -> None:
    """Parse a 64 KiB KV page message until stopped (pure Python / protobuf work holding the GIL)."""
    page = kv_pb2.KVPageBatch(payload=b"\x01" * (64 << 10)).SerializeToString()
    n = 0
    while not stop.is_set():
        kv_pb2.KVPageBatch.FromString(page)
        n += 1
    counts.append(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--intervals-us", default="5000,1000,200,50")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.ones(1024, device=args.device)
    op_loop(x, 100)
    print(f"{'interval us':>11} {'alone ms':>9} {'beside ms':>10} {'x alone':>8} {'busy thread msgs/s':>19}")
    for us in (float(v) for v in args.intervals_us.split(",")):
        sys.setswitchinterval(us / 1e6)
        alone = statistics.median(op_loop(x, args.ops) for _ in range(args.reps))
        stop, counts = threading.Event(), []
        th = threading.Thread(target=busy, args=(stop, counts), daemon=True)
        t0 = time.perf_counter()
        th.start()
        time.sleep(0.02)
        beside = statistics.median(op_loop(x, args.ops) for _ in range(args.reps))
        stop.set()
        th.join()
        rate = counts[0] / (time.perf_counter() - t0)
        print(f"{us:>11g} {alone:>9.1f} {beside:>10.1f} {beside / alone:>8.1f} {rate:>19.0f}")


if __name__ == "__main__":
    main()
