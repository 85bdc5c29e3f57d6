"""The router's head start side by side: the disaggregated stack on this host's GPU 0 (`pdserve up`'s one-GPU
stack: MPS auto, `--mps`) with the router's `--prefill-head-start` on and off, alternated stack by stack on one host (a
fresh host's stacks differ by ~1 ms: the order decides nothing here), each serving single 2048-token requests of
fresh prompts (`bench/gpu_serving.py`'s served_ttft: first and second token at the client, medians of `--reps`).

    python bench/diag/head_start.py --model DIR [--transports cuda-ipc,grpc-shm] [--rounds 2] [--reps 9]

(GPU: its prompts are of an 8B Llama's vocabulary, `gpu_serving.fresh`.)

Prints one row per stack and the medians per (transport, head start). Figures: docs/benchmarks.md, "One GPU"."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchutil import log, model_or_tiny
from gpu_serving import served_ttft


def head_start_counts(stack) -> dict[str, int]:
    """The prefill's `pdserve_head_starts_*_total` counters ({} where its /metrics is off)."""
    from pdserve.testing.scrape import metric_samples

    if not stack.prefill[0].metrics:
        return {}
    samples = metric_samples(stack.prefill[0].metrics)
    prefix = "pdserve_head_starts_"
    return {
        k[len(prefix) : -len("_total")]: int(v)
        for k, v in samples.items()
        if k.startswith(prefix) and k.endswith("_total")
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a model directory (default: a tiny random Llama, written here)")
    ap.add_argument("--transports", default="cuda-ipc,grpc-shm", help="KV transports, one pair of stacks each")
    ap.add_argument("--rounds", type=int, default=2, help="on/off pairs per transport")
    ap.add_argument("--reps", type=int, default=9, help="single requests per stack (after one warm-up)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no stack past this many seconds")
    ap.add_argument("--mps", default="auto", choices=("off", "auto", "on"), help="`pdserve up --mps` (its default)")
    args = ap.parse_args()
    from pdserve.cli.launch import start_stack

    gpus = [0] if torch.cuda.is_available() else []
    model, _ = model_or_tiny(args.model, Path(tempfile.mkdtemp(prefix="head-start-model-")))
    t_start, rows = time.monotonic(), []
    for transport in args.transports.split(","):
        for rnd in range(args.rounds):
            for on in (True, False) if rnd % 2 == 0 else (False, True):
                if time.monotonic() - t_start > args.budget_s:
                    log(f"budget reached: no stack for {transport} round {rnd} head start {on}")
                    continue
                work = Path(tempfile.mkdtemp(prefix="head-start-"))
                extra = ["--kv-transport", transport, "--max-num-seqs", "64"] + (
                    [] if gpus else ["--torch-threads", "1"]
                )
                router = [] if on else ["--prefill-head-start", "false"]
                stack = start_stack(model, work, gpus=gpus, extra=extra, timeout=600, router_extra=router, mps=args.mps)
                try:
                    key = {"cuda-ipc": "ipc", "grpc-shm": "shm"}.get(transport, "grpc")
                    got = served_ttft(stack, transport, torch.Generator().manual_seed(rnd), args.reps)
                    row = (transport, on, got[f"served_ttft_ms_2k_{key}"], got[f"served_t2t_ms_2k_{key}"])
                    rows.append(row)
                    counts = head_start_counts(stack)  # taken: the stream used the router's start
                    log(f"{transport} head start {'on ' if on else 'off'}: TTFT {row[2]:.2f} ms, t2t {row[3]:.2f} ms; "
                        f"prefill's head starts {counts}")  # fmt: skip
                finally:
                    stack.stop()
    print("| transport | head start | stacks | served TTFT 2k ms (median of stacks) | second token ms |")
    print("|---|---|---|---|---|")
    for transport in args.transports.split(","):
        for on in (True, False):
            mine = [r for r in rows if r[0] == transport and r[1] == on]
            if mine:
                ttft, t2t = statistics.median(r[2] for r in mine), statistics.median(r[3] for r in mine)
                each = ", ".join(f"{r[2]:.1f}/{r[3]:.1f}" for r in mine)
                print(f"| {transport} | {'on' if on else 'off'} | {each} | {ttft:.2f} | {t2t:.2f} |")


if __name__ == "__main__":
    main()
