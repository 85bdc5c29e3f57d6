"""One request's first and second token through `pdserve up --disaggregated` on one GPU at several prefill
`--kv-layer-group` sizes (layers per KV shipment of a computed chunk; 0: whole chunks), the 8B shape with random
weights made by each engine (`--load-format dummy`: no checkpoint written), int8 KV, the stack's defaults otherwise
(MPS auto).

    python bench/diag/layer_groups.py [--groups 4,0,8] [--transport cuda-ipc|grpc] [--reps 7]

Prints per group bench/gpu_serving.py's `served_ttft` figures (TTFT and second token medians and every run, KV
GB/s). Figures: docs/benchmarks.md, "One GPU"."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp8_weights as fw
import gpu_engine as ge
import gpu_serving as gs
import one_gpu as og


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="4,0,8")
    ap.add_argument("--transport", default="cuda-ipc", choices=("cuda-ipc", "grpc"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gpus", default="0")
    args = ap.parse_args()
    from pdserve.server.auth import new_token
    from pdserve.testing.up_process import stop

    up_args = SimpleNamespace(gpus=args.gpus, ready_timeout=300.0)
    tmp = Path(tempfile.mkdtemp(prefix="layer-groups-"))
    model = fw.write_config_dir(tmp / "model", ge.SHAPE, 32, None)
    flags = ("--load-format", "dummy", "--kv-transport", args.transport)
    t0 = time.monotonic()
    for group in args.groups.split(","):
        os.environ["PDSERVE_PREFILL_KV_LAYER_GROUP"] = group.strip()
        proc, _, stack = og.up_stack(model, "disagg", tmp, up_args, new_token(), flags)
        try:
            res = gs.served_ttft(stack, args.transport, torch.Generator().manual_seed(0), reps=args.reps)
        finally:
            stop(proc, timeout_s=60)
        shown = {k: v for k, v in res.items() if "counters" not in k}
        print(f"[{time.monotonic() - t0:.0f} s] --kv-layer-group {group}: {shown}", flush=True)


if __name__ == "__main__":
    main()
