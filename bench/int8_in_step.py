"""Why the int8 decode kernel is slower inside the engine's step than alone (issue 14): the kernel's CUDA time per
call alone, after a memory-bound GEMM, and after three, on one Hopper GPU, with the SM clock sampled meanwhile.

    python bench/int8_in_step.py [--json OUT] [--once]

Batch 128, context 2k, Llama-3-8B heads (8 KV, 32 query, head_dim 128, page 16). Each scenario is one CUDA graph of
8 repeats, replayed under torch.profiler; the kernel's time is its mean CUDA time. The GEMM is a decode batch's
MLP up-projection ([128, 4096] x [4096, 28672] bf16: 235 MB of weights, memory bound). `nvidia-smi` samples the SM
clock and the power every 50 ms while a scenario runs. `int8` is the byte-plane kernel (kernels/int8_fold2_decode.py),
the default before the lean loop. The bf16 pool through the same kernel family is the contrast
(memory bound at any clock); `int8_lean` is the lean loop (kernels/int8_planes_decode.py). `--once`: one call of
the int8 kernel and exit (for `ncu`; `--lean`: the lean loop's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_engine as ge

DEV = ge.DEV
PS, KVH, D, HQ, B, CTX = 16, 8, 128, 32, 128, 2048


def kernel_fns() -> dict:
    from pdserve.engine.kernels import int8_decode_attention as kd

    g = torch.Generator(device=DEV).manual_seed(14)
    kv, q8, s8, table, lens, qq = ge.paged_decode_inputs(B, CTX, g, PS, KVH, D, HQ)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    splits = kd.default_num_splits(B, KVH, sms, kd.DEFAULT_CONFIG["split_mult"])
    cfg = {k: v for k, v in kd.DEFAULT_CONFIG.items() if k != "split_mult"}
    dense = {k: v for k, v in kd.DENSE_CONFIG.items() if k != "split_mult"}
    dense_splits = kd.default_num_splits(B, KVH, sms, kd.DENSE_CONFIG["split_mult"])

    def int8(**kw):
        return lambda: kd.int8_paged_decode(
            qq, q8[0], q8[1], s8[0], s8[1], None, None, table, lens, D**-0.5, splits, **{**cfg, **kw}
        )

    return {
        "int8": int8(lean_loop=False),  # the byte-plane kernel (the default until the lean loop)
        "int8_lean": int8(lean_loop=True),
        "int8_lean_pdl": int8(lean_loop=True, pdl=True),
        "bf16": lambda: kd.int8_paged_decode(
            qq, kv[0], kv[1], None, None, None, None, table, lens, D**-0.5, dense_splits, **dense
        ),
    }


class ClockSampler:
    """nvidia-smi sampling SM clock (MHz) and power (W) every 50 ms until stopped."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
            + ["-lms", "50"],
            stdout=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> dict:
        self.proc.terminate()
        out, _ = self.proc.communicate()
        rows = [tuple(float(x) for x in line.split(",")) for line in out.splitlines() if line.count(",") == 1]
        if not rows:
            return {}
        return {
            "sm_mhz_median": statistics.median(r[0] for r in rows),
            "power_w_median": statistics.median(r[1] for r in rows),
        }


def kernel_times(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, float]:
    """Mean CUDA µs per call of each kernel over `replays` replays of graph."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return {ev.key[:60]: ev.device_time_total / ev.count for ev in prof.key_averages() if ev.count}


def scenario(attn, gemms: int, w: torch.Tensor, x: torch.Tensor, seconds: float = 3.0) -> dict:
    def body() -> None:
        for _ in range(8):
            for _ in range(gemms):
                torch.matmul(x, w.t())
            attn()

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    sampler = ClockSampler()
    time.sleep(0.3)
    t_end = time.monotonic() + seconds  # long enough for the clock to settle
    n = 0
    while time.monotonic() < t_end:
        graph.replay()
        n += 1
        if n % 20 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    times = kernel_times(graph, 20)
    clocks = sampler.stop()
    attn_us = {k: v for k, v in times.items() if "decode_kernel" in k}
    return {"attn_us": attn_us, "all_us": times, **clocks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    ap.add_argument("--once", action="store_true")
    ap.add_argument("--lean", action="store_true")
    args = ap.parse_args()
    fns = kernel_fns()
    if args.once:
        for _ in range(3):
            fns["int8_lean" if args.lean else "int8"]()
        torch.cuda.synchronize()
        return
    w = torch.randn(28672, 4096, dtype=torch.bfloat16, device=DEV) * 0.02  # [N, K]
    x = torch.randn(B, 4096, dtype=torch.bfloat16, device=DEV)  # [B, K]
    out: dict = {}
    for name in ("int8", "int8_lean", "int8_lean_pdl", "bf16"):
        for gemms in (0, 1, 3):
            r = scenario(fns[name], gemms, w, x)
            key = f"{name}_after_{gemms}_gemm"
            out[key] = r
            ge.row(
                f"{name} kernel, {gemms} GEMM(s) before each",
                ", ".join(f"{k} {v:.1f} us" for k, v in r["attn_us"].items()),
                f"SM {r.get('sm_mhz_median', 0):.0f} MHz, {r.get('power_w_median', 0):.0f} W",
            )
    ge.print_rows()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
