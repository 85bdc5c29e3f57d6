"""How two CUDA workloads share one GPU: a decode-like CUDA graph (16 bf16 GEMMs at M = 8 over 1.9 GB of weights,
memory bound, ~0.5 ms on an H200) and a prefill-like burst (32 GEMMs 8192x4096x14336, compute bound, ~47 ms),
each looping for DUR seconds (default 6).

    python bench/diag/mps_probe.py procs     # each alone, then both as two processes (time slices, or MPS clients
                                             # when $CUDA_MPS_PIPE_DIRECTORY names a running daemon)
    python bench/diag/mps_probe.py threads   # both in one process, the decode stream at normal / high priority
    python bench/diag/mps_probe.py mps       # under a running daemon: the prefill at 100/80/65/50% of the SMs
                                             # (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), the decode at 100 / 35%

Start a daemon for `mps` with `CUDA_MPS_PIPE_DIRECTORY=D/pipe CUDA_MPS_LOG_DIRECTORY=D/log nvidia-cuda-mps-control
-d` (the same environment for this script) and end it with `echo quit | nvidia-cuda-mps-control`. Prints the decode
graph's p50 / p90 / mean ms and replay count, the burst's median ms and count. Figures: docs/benchmarks.md, "One
GPU"; `pdserve up --mps` (pdserve.cli.mps) is what came of them."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch

DUR = float(os.environ.get("DUR", "6"))
Stop = Callable[[], bool]


def decode_setup(high_priority: bool = False) -> tuple:
    ws = [torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(16)]  # 16 x [N, K]
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)  # [M, K]
    s = torch.cuda.Stream(priority=-1 if high_priority else 0)
    with torch.cuda.stream(s):
        for w in ws:
            x @ w.t()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        outs = [x @ w.t() for w in ws]
    return g, s, (ws, x, outs)


def prefill_setup() -> tuple:
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16)
    return a, b, torch.cuda.Stream()


def run_decode(stop: Stop, out: dict, state: tuple) -> None:
    g, s, _ = state
    t = []
    while not stop():
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            g.replay()
        s.synchronize()
        t.append((time.perf_counter() - t0) * 1e3)
    t = sorted(t[3:])
    out.update(decode_ms_p50=round(t[len(t) // 2], 3), decode_ms_p90=round(t[int(len(t) * 0.9)], 3),
               decode_ms_mean=round(sum(t) / len(t), 3), decode_n=len(t))  # fmt: skip


def run_prefill(stop: Stop, out: dict, state: tuple) -> None:
    a, b, s = state
    t = []
    while not stop():
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            for _ in range(32):
                a @ b.t()
        s.synchronize()
        t.append((time.perf_counter() - t0) * 1e3)
    out.update(prefill_ms=round(statistics.median(t[2:]), 2), prefill_n=len(t))


def child(role: str) -> None:
    """One workload in its own process: set up, say READY, run DUR seconds from the parent's go, print JSON."""
    state = decode_setup() if role == "decode" else prefill_setup()
    torch.cuda.synchronize()
    print("READY", flush=True)
    sys.stdin.readline()
    end = time.monotonic() + DUR
    out: dict = {}
    (run_decode if role == "decode" else run_prefill)(lambda: time.monotonic() > end, out, state)
    print(json.dumps(out), flush=True)


def procs(roles: list[str], sm_percent: dict[str, int] | None = None) -> dict:
    """`roles` as processes started together (`sm_percent`: each one's MPS SM share)."""
    pct = sm_percent or {}
    ps = []
    for r in roles:
        env = {**os.environ, **({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(pct[r])} if r in pct else {})}
        cmd = [sys.executable, __file__, "child", r]
        ps.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
    for p in ps:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    for p in ps:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    res: dict = {}
    for p in ps:
        assert p.stdout is not None
        res.update(json.loads(p.stdout.readline()))
        p.wait()
    return res


def threads(high_priority: bool) -> dict:
    d, p = decode_setup(high_priority), prefill_setup()
    torch.cuda.synchronize()
    end = time.monotonic() + DUR
    out: dict = {}
    stop = lambda: time.monotonic() > end
    ts = [threading.Thread(target=fn, args=(stop, out, st)) for fn, st in ((run_decode, d), (run_prefill, p))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def main() -> None:
    mode = sys.argv[1]
    if mode == "child":
        child(sys.argv[2])
    elif mode == "procs":
        print("decode alone", procs(["decode"]), flush=True)
        print("prefill alone", procs(["prefill"]), flush=True)
        print("both, two processes", procs(["decode", "prefill"]), flush=True)
    elif mode == "threads":
        print("both, one process, same priority", threads(False), flush=True)
        print("both, one process, decode stream high priority", threads(True), flush=True)
    elif mode == "mps":
        for pp in (100, 80, 65, 50):
            for dp in (100, 35):
                print(f"MPS prefill {pp}% decode {dp}%", procs(["decode", "prefill"], {"prefill": pp, "decode": dp}))
    else:
        sys.exit(f"unknown mode {mode!r}: procs, threads or mps")


if __name__ == "__main__":
    main()
