"""FP8 GEMM sweep for decode batches above the GEMV (issue 30): one layer's four projections at M = 32..256 tokens
on the 8B and 70B shapes, through cuBLAS (`torch._scaled_mm`, rowwise or block scales), the Triton GEMM
(`fp8_block_gemm`) at its default config (`skinny_config`) and at every `CONFIGS` entry, and bf16 cuBLAS beside them.

    python bench/fp8_gemm_sweep.py [--json out.json] [--models 8b,70b] [--ms 32,64,128,256]     # GPU, ~3 min

Every timing is a CUDA graph of one projection over enough distinct copies of its weights that together they
exceed L2 (so each replay streams the weights from HBM, as a decode step does), median of `--reps` replays, divided
by the copies; a layer's time is the sum over its four projections (per config, and with each projection's best
config). Activations are quantized once outside the timing (the engine's RMSNorm / SwiGLU kernels write them
quantized: Fp8Linear.takes_fp8). TB/s = the layer's FP8 weight bytes / time. A Triton config whose per-channel
product differs from cuBLAS's on the same operands by more than 2e-2 (relative) is logged and dropped.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from benchutil import log
from fp8_gemv_sweep import graph_us

from pdserve.engine.quant import fp8_block_gemm as G
from pdserve.engine.quant import fp8_quant as Q

MODELS = {
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}
L2_BYTES = 200 << 20  # weight bytes per graph at least (H200 L2: 50 MiB)
# (BM, BN, BK, num_warps, num_stages, programs per SM for the split (0: no split), TMA loads): per-channel configs;
# block scales take those with BK = 128 and no TMA. Row tiles of one column tile run next to each other (GROUP_M
# = row tiles), so a batch of two row tiles reads each weight byte from HBM once
CONFIGS = [
    (64, 64, 128, 4, 6, 2, 0), (64, 64, 128, 4, 8, 2, 0), (64, 64, 256, 4, 4, 2, 0), (64, 32, 128, 4, 6, 4, 0),
    (64, 128, 128, 4, 4, 2, 0), (128, 64, 128, 4, 4, 2, 0), (128, 128, 256, 8, 3, 1, 0), (128, 128, 128, 8, 4, 1, 0),
    (64, 64, 128, 4, 6, 4, 0), (64, 64, 128, 4, 6, 0, 0),
    (64, 64, 128, 4, 6, 2, 1), (64, 64, 256, 4, 4, 2, 1), (64, 128, 128, 4, 4, 2, 1), (64, 128, 256, 4, 3, 1, 1),
    (128, 64, 128, 4, 4, 2, 1), (128, 128, 128, 8, 4, 1, 1), (128, 128, 256, 8, 3, 1, 1), (64, 64, 128, 4, 8, 4, 1),
    (128, 256, 128, 8, 3, 1, 1), (64, 256, 128, 8, 3, 1, 1),
]  # fmt: skip


def graph_ms(fns: list, reps: int) -> float:
    """Median ms of one replay of a CUDA graph of fns (fp8_gemv_sweep's timing)."""
    return graph_us(fns, reps) / 1e3


class Layer:
    """Per projection, enough distinct copies of its FP8 weights (per channel and block scales) and of its bf16 weight
    that a graph over them streams from HBM; tickets per copy."""

    def __init__(self, shapes: dict, dev: torch.device):
        self.shapes = shapes
        self.fp8_bytes = sum(n * k for n, k in shapes.values())
        self.copies = {p: max(1, math.ceil(L2_BYTES / (n * k))) for p, (n, k) in shapes.items()}
        self.chan, self.block, self.bf16, self.tickets = {}, {}, {}, {}
        for p, (n, k) in shapes.items():
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
            chan, block = Q.quantize_weight_per_channel(w), Q.quantize_weight_blocks(w)
            c = self.copies[p]
            self.chan[p] = [chan] + [tuple(t.clone() for t in chan) for _ in range(c - 1)]
            self.block[p] = [block] + [tuple(t.clone() for t in block) for _ in range(c - 1)]
            self.bf16[p] = [w] + [w.clone() for _ in range(max(1, math.ceil(L2_BYTES / (2 * n * k))) - 1)]
            self.tickets[p] = [torch.zeros(G.counter_slots(G.SKINNY_MAX_ROWS, n), dtype=torch.int32, device=dev)
                               for _ in range(c)]  # fmt: skip


def run_model(name: str, layer: Layer, ms: list[int], reps: int, sms: int, dev: torch.device) -> list[dict]:
    """Per M: each projection's time (ms) through bf16 cuBLAS, cuBLAS FP8 (rowwise, block) and the Triton GEMM at
    its default config and every CONFIGS entry; a layer's time = the sum over its projections."""
    rows = []
    for m in ms:
        x = {p: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for p, (_, k) in layer.shapes.items()}
        xc = {p: Q.quantize_activations(v, None) for p, v in x.items()}
        xb = {p: Q.quantize_activations(v, 128) for p, v in x.items()}
        xbc = {p: Q.quantize_activations(v, 128, col_major=True) for p, v in x.items()}

        def timed(p: str, fn_of_copy, copies: int) -> float:
            return graph_ms([lambda i=i: fn_of_copy(i) for i in range(copies)], reps) / copies

        row: dict = {"model": name, "m": m, "fp8_bytes": layer.fp8_bytes, "proj": {}}
        for p, (n, k) in layer.shapes.items():
            pr: dict = {}
            pr["bf16"] = timed(p, lambda i, p=p: torch.nn.functional.linear(x[p], layer.bf16[p][i]), len(layer.bf16[p]))
            pr["cublas_channel"] = timed(p, lambda i, p=p: torch._scaled_mm(
                xc[p][0], layer.chan[p][i][0].t(), scale_a=xc[p][1], scale_b=layer.chan[p][i][1].view(1, -1),
                out_dtype=torch.bfloat16, use_fast_accum=True), layer.copies[p])  # fmt: skip
            try:
                pr["cublas_block"] = timed(p, lambda i, p=p: torch._scaled_mm(
                    xbc[p][0], layer.block[p][i][0].t(), scale_a=xbc[p][1], scale_b=layer.block[p][i][1].t(),
                    out_dtype=torch.bfloat16), layer.copies[p])  # fmt: skip
            except Exception as exc:
                log(f"cuBLAS block m={m} {p}: {type(exc).__name__}: {str(exc)[:120]}")
            ref = torch._scaled_mm(xc[p][0], layer.chan[p][0][0].t(), scale_a=xc[p][1],
                                   scale_b=layer.chan[p][0][1].view(1, -1), out_dtype=torch.float32)  # fmt: skip
            for scheme in ("channel", "block"):
                variants = [("default", None)] + [
                    (str(c), c) for c in CONFIGS if scheme == "channel" or (c[2] == 128 and not c[6])
                ]
                for label, c in variants:
                    cfg = (
                        G.config_from_tuple(c, m, n, k, sms)
                        if c
                        else G.skinny_config(m, n, k, scheme == "channel", sms)
                    )
                    try:
                        if scheme == "channel":

                            def fn(i, p=p, cfg=cfg):
                                return G.channel_gemm(*xc[p], *layer.chan[p][i], config=cfg,
                                                      counters=layer.tickets[p][i])  # fmt: skip

                            out = fn(0).float()
                            if ((out - ref).norm() / ref.norm()).item() > 2e-2:
                                log(f"{name} {p} m={m} {label}: wrong product")
                                continue
                        else:

                            def fn(i, p=p, cfg=cfg):
                                return G.block_gemm(*xb[p], *layer.block[p][i], config=cfg,
                                                    counters=layer.tickets[p][i])  # fmt: skip

                        pr[f"triton_{scheme} {label}"] = timed(p, fn, layer.copies[p])
                    except Exception as exc:
                        log(f"{scheme} {label} m={m} {p}: {type(exc).__name__}: {str(exc)[:160]}")
            for scheme in ("channel", "block"):  # what Fp8Linear runs: the table's config, else cuBLAS
                mine = G.skinny_tuple(m, n, k, scheme == "channel")
                pr[f"engine_{scheme}"] = pr.get(f"triton_{scheme} default") if mine else pr.get(f"cublas_{scheme}")
            row["proj"][p] = pr
        layer_ms = {}
        keys = set.intersection(*(set(pr) for pr in row["proj"].values()))
        for key in keys:
            layer_ms[key] = sum(pr[key] for pr in row["proj"].values())
        for scheme in ("channel", "block"):
            mine = [key for key in layer_ms if key.startswith(f"triton_{scheme} ")]
            if mine:
                best = min(mine, key=layer_ms.get)
                row[f"triton_{scheme}_best"], row[f"triton_{scheme}_best_ms"] = best, layer_ms[best]
                row[f"triton_{scheme}_default_ms"] = layer_ms.get(f"triton_{scheme} default")
                per_proj = {p: min((k_ for k_ in pr if k_.startswith(f"triton_{scheme} ")), key=pr.get)
                            for p, pr in row["proj"].items()}  # fmt: skip
                row[f"triton_{scheme}_per_proj_best"] = per_proj
                row[f"triton_{scheme}_per_proj_best_ms"] = sum(row["proj"][p][k_] for p, k_ in per_proj.items())
        for key in ("bf16", "cublas_channel", "cublas_block", "engine_channel", "engine_block"):
            if key in layer_ms:
                row[f"{key}_ms"] = layer_ms[key]
        rows.append(row)
        tb = {k_: layer.fp8_bytes / v / 1e9 for k_, v in row.items() if k_.endswith("_ms") and v}
        log(f"{name} M={m}: " + ", ".join(f"{k_[:-3]} {row[k_] * 1e3:.1f} us ({tb[k_]:.2f})" for k_ in tb))
        for scheme in ("channel", "block"):
            log(f"   {scheme} best per projection: {row.get(f'triton_{scheme}_per_proj_best')}")
    return rows


def skinny_table(rows: list[dict], margin: float = 0.97) -> str:
    """fp8_block_gemm.SKINNY_CONFIGS from a sweep: per (scheme, M, N, K) the fastest Triton config where it beat
    cuBLAS by more than 1 - `margin`, else None."""
    lines = []
    for r in rows:
        for scheme in ("channel", "block"):
            for p, pr in r["proj"].items():
                n, k = MODELS[r["model"]][p]
                mine = {key: v for key, v in pr.items() if key.startswith(f"triton_{scheme} ") and v}
                if not mine:
                    continue
                best = min(mine, key=mine.get)
                label = best.split(" ", 1)[1]
                if label == "default":  # the config the table (or its rule) gave this run
                    label = str(G.skinny_tuple(r["m"], n, k, scheme == "channel")
                                or (G.SKINNY_RULE_CHANNEL if scheme == "channel" else G.SKINNY_RULE_BLOCK))  # fmt: skip
                cublas = pr.get(f"cublas_{scheme}")
                choice = label if cublas is None or mine[best] < margin * cublas else "None"
                lines.append(f"    ({scheme == 'channel'}, {r['m']}, {n}, {k}): {choice},")
    return "SKINNY_CONFIGS = {\n" + "\n".join(lines) + "\n}"


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
    print("\n| model | M | bf16 | cuBLAS FP8 channel | cuBLAS FP8 block | Triton channel default / best / best per "
          "projection | Triton block default / best / per projection |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for r in out["rows"]:

        def us(key):
            v = r.get(key)
            return f"{v * 1e3:.1f}" if v else "-"

        print(
            f"| {r['model']} | {r['m']} | {us('bf16_ms')} | {us('cublas_channel_ms')} | {us('cublas_block_ms')} | "
            f"{us('triton_channel_default_ms')} / {us('triton_channel_best_ms')} {r.get('triton_channel_best')} | "
            f"{us('triton_block_default_ms')} / {us('triton_block_best_ms')} {r.get('triton_block_best')} |"
        )
    print("\nengine (the table's choice per projection) vs all cuBLAS, us per layer:")
    for r in out["rows"]:
        print(f"  {r['model']} M={r['m']}: channel {r.get('engine_channel_ms', 0) * 1e3:.1f} vs "
              f"{r.get('cublas_channel_ms', 0) * 1e3:.1f}, block {r.get('engine_block_ms', 0) * 1e3:.1f} vs "
              f"{r.get('cublas_block_ms', 0) * 1e3:.1f}")  # fmt: skip
    out["skinny_table"] = skinny_table(out["rows"])
    print(out["skinny_table"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
