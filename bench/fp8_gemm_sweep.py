"""FP8 GEMM sweep for decode batches above the GEMV (issue 30): one layer's four projections at M = 32..256 tokens
on the 8B and 70B shapes, through cuBLAS (`torch._scaled_mm`, rowwise or block scales), the Triton GEMM
(`fp8_block_gemm`) at its default config (`skinny_config`) and at every `CONFIGS` entry, and bf16 cuBLAS beside them.

    python bench/fp8_gemm_sweep.py [--json out.json] [--models 8b,70b] [--ms 32,64,128,256]     # GPU, ~3 min

Every timing is a CUDA graph of the four projections over `copies` distinct weight sets (together more than L2
holds, so each replay streams the weights from HBM as a decode step does), median of `--reps` replays, divided
by the copies: ms per layer. Activations are quantized once outside the timing (the engine's RMSNorm / SwiGLU
kernels write them quantized: Fp8Linear.takes_fp8). TB/s = FP8 weight bytes / time. Each Triton config's output is
checked against cuBLAS's on the same operands (relative error, printed; > 2e-2 fails the row).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import triton
from benchutil import log

from pdserve.engine.quant import fp8_block_gemm as G
from pdserve.engine.quant import fp8_quant as Q

MODELS = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}
L2_BYTES = 200 << 20  # weight bytes per graph at least (H200 L2: 50 MiB)
# (BM, BN, BK, num_warps, num_stages, programs per SM for the split; 0: no split): per-channel configs; block
# scales take those with BK = 128
CONFIGS = [
    (128, 64, 128, 4, 4, 2), (128, 64, 256, 4, 3, 2), (128, 64, 128, 4, 6, 2), (128, 64, 128, 4, 4, 4),
    (128, 64, 128, 4, 4, 0), (128, 128, 128, 8, 4, 1), (128, 128, 128, 4, 4, 2), (128, 128, 256, 8, 3, 1),
    (128, 32, 256, 4, 4, 2), (128, 32, 128, 4, 6, 4), (64, 64, 256, 4, 4, 2), (64, 64, 128, 4, 6, 2),
    (64, 128, 128, 4, 4, 2), (128, 256, 128, 8, 3, 1),
]  # fmt: skip


def config_dict(c: tuple, m: int, n: int, k: int, sms: int) -> dict:
    bm, bn, bk, nw, ns, pps = c
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = G.split_for(tiles, triton.cdiv(k, bk), pps * sms) if pps else 1
    return dict(BM=bm, BN=bn, BK=bk, GROUP_M=1, num_warps=nw, num_stages=ns, split=split)


def graph_ms(fns: list, reps: int) -> float:
    """Median ms of one replay of a CUDA graph of fns."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


class Layer:
    """`copies` distinct FP8 copies of one layer's projections (per channel and block scales), a bf16 one, tickets."""

    def __init__(self, shapes: dict, dev: torch.device):
        self.shapes = shapes
        fp8_bytes = sum(n * k for n, k in shapes.values())
        self.copies = max(1, math.ceil(L2_BYTES / fp8_bytes))
        self.w16 = {p: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for p, (n, k) in shapes.items()}
        self.w16_copies = max(1, math.ceil(L2_BYTES / (2 * fp8_bytes)))
        self.chan, self.block = [], []
        for _ in range(self.copies):
            self.chan.append({p: Q.quantize_weight_per_channel(w) for p, w in self.w16.items()})
            self.block.append({p: Q.quantize_weight_blocks(w) for p, w in self.w16.items()})
        self.bf16 = [{p: w.clone() for p, w in self.w16.items()} for _ in range(self.w16_copies)]
        self.tickets = [{p: torch.zeros(G.counter_slots(G.SKINNY_MAX_ROWS, n), dtype=torch.int32, device=dev)
                         for p, (n, _) in shapes.items()} for _ in range(self.copies)]  # fmt: skip
        self.fp8_bytes = fp8_bytes

    def inputs(self, m: int, dev: torch.device) -> dict:
        x = {p: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for p, (_, k) in self.shapes.items()}
        return dict(x=x, chan={p: Q.quantize_activations(v, None) for p, v in x.items()},
                    block={p: Q.quantize_activations(v, 128) for p, v in x.items()},
                    block_cm={p: Q.quantize_activations(v, 128, col_major=True) for p, v in x.items()})  # fmt: skip


def run_model(name: str, layer: Layer, ms: list[int], reps: int, sms: int, dev: torch.device) -> list[dict]:
    rows = []
    for m in ms:
        inp = layer.inputs(m, dev)
        x, xc, xb, xbc = inp["x"], inp["chan"], inp["block"], inp["block_cm"]
        per = layer.copies

        def timed(fn_of_copy, copies=per) -> float:
            return (
                graph_ms([lambda i=i, p=p: fn_of_copy(i, p) for i in range(copies) for p in layer.shapes], reps)
                / copies
            )

        row: dict = {"model": name, "m": m}
        row["bf16_ms"] = timed(lambda i, p: torch.nn.functional.linear(x[p], layer.bf16[i][p]), layer.w16_copies)
        row["cublas_channel_ms"] = timed(lambda i, p: torch._scaled_mm(
            xc[p][0], layer.chan[i][p][0].t(), scale_a=xc[p][1], scale_b=layer.chan[i][p][1].view(1, -1),
            out_dtype=torch.bfloat16, use_fast_accum=True))  # fmt: skip
        try:
            row["cublas_block_ms"] = timed(lambda i, p: torch._scaled_mm(
                xbc[p][0], layer.block[i][p][0].t(), scale_a=xbc[p][1], scale_b=layer.block[i][p][1].t(),
                out_dtype=torch.bfloat16))  # fmt: skip
        except Exception as exc:
            log(f"cuBLAS block m={m}: {type(exc).__name__}: {str(exc)[:120]}")
        ref = {p: torch._scaled_mm(xc[p][0], layer.chan[0][p][0].t(), scale_a=xc[p][1],
                                   scale_b=layer.chan[0][p][1].view(1, -1), out_dtype=torch.float32)
               for p in layer.shapes}  # fmt: skip
        for scheme in ("channel", "block"):
            variants = [("default", None)] + [(str(c), c) for c in CONFIGS if scheme == "channel" or c[2] == 128]
            results = []
            for label, c in variants:
                cfgs = {p: (config_dict(c, m, n, k, sms) if c else G.default_config(m, n, sms, k, scheme == "channel"))
                        for p, (n, k) in layer.shapes.items()}  # fmt: skip
                try:
                    if scheme == "channel":

                        def fn(i, p):
                            return G.channel_gemm(*xc[p], *layer.chan[i][p], config=cfgs[p],
                                                  counters=layer.tickets[i][p])  # fmt: skip
                    else:

                        def fn(i, p):
                            return G.block_gemm(*xb[p], *layer.block[i][p], config=cfgs[p],
                                                counters=layer.tickets[i][p])  # fmt: skip

                    err = 0.0
                    if scheme == "channel":
                        for p in layer.shapes:
                            out = fn(0, p).float()
                            err = max(err, ((out - ref[p]).norm() / ref[p].norm()).item())
                    ms_ = timed(fn)
                    results.append({"config": label, "ms": ms_, "err": err,
                                    "splits": {p: cfg["split"] for p, cfg in cfgs.items()}})  # fmt: skip
                except Exception as exc:
                    log(f"{scheme} {label} m={m}: {type(exc).__name__}: {str(exc)[:160]}")
            ok = [r for r in results if r["err"] < 2e-2]
            row[f"triton_{scheme}"] = results
            if ok:
                best = min(ok, key=lambda r: r["ms"])
                row[f"triton_{scheme}_default_ms"] = next((r["ms"] for r in ok if r["config"] == "default"), None)
                row[f"triton_{scheme}_best_ms"], row[f"triton_{scheme}_best"] = best["ms"], best["config"]
        row["fp8_bytes"] = layer.fp8_bytes
        rows.append(row)
        tb = {k: layer.fp8_bytes / v / 1e9 for k, v in row.items() if k.endswith("_ms") and v}
        log(f"{name} M={m}: " + ", ".join(f"{k[:-3]} {row[k] * 1e3:.1f} us ({tb[k]:.2f})" for k in tb)
            + f"; best channel {row.get('triton_channel_best')}, block {row.get('triton_block_best')}")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--models", default="8b,70b")
    ap.add_argument("--ms", default="32,64,128,256")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    t0 = time.perf_counter()
    out: dict = {"device": torch.cuda.get_device_name(dev), "configs": [list(c) for c in CONFIGS], "rows": []}
    for name in args.models.split(","):
        layer = Layer(MODELS[name], dev)
        out["rows"] += run_model(name, layer, [int(v) for v in args.ms.split(",")], args.reps, sms, dev)
        del layer
        torch.cuda.empty_cache()
    out["run_s"] = time.perf_counter() - t0
    print("\n| model | M | bf16 | cuBLAS FP8 channel | cuBLAS FP8 block | Triton channel default / best | Triton block "
          "default / best |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for r in out["rows"]:

        def us(key):
            v = r.get(key)
            return f"{v * 1e3:.1f}" if v else "-"

        print(
            f"| {r['model']} | {r['m']} | {us('bf16_ms')} | {us('cublas_channel_ms')} | {us('cublas_block_ms')} | "
            f"{us('triton_channel_default_ms')} / {us('triton_channel_best_ms')} {r.get('triton_channel_best')} | "
            f"{us('triton_block_default_ms')} / {us('triton_block_best_ms')} {r.get('triton_block_best')} |"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
