"""FP8 weights on one GPU (issue 30): GEMM throughput of the 8B projections in bf16, FP8 per-channel
(`torch._scaled_mm`, rowwise scales) and FP8 block-scaled (Triton), activation quantization included; then engine
decode step times (int8 KV) on a random 8B-shaped checkpoint: bf16, online FP8 and a block-scaled FP8 copy.
Per channel, both GEMMs are timed at every M: `_scaled_mm` and the Triton GEMM (Fp8Linear.triton_max_rows picks
between them in the engine).
Prints a table and writes docs/bench/fp8_weights.json.

    python bench/fp8_weights.py [--layers 8] [--steps 32] [--out docs/bench/fp8_weights.json]

Weights are random (generated on the device, written as a bf16 checkpoint of `--layers` 8B layers; the block copy
is quantized from it on the CPU): the timings depend on shapes, not values. GEMM times are CUDA-graph replays of
the four projections of one layer (what a decode graph runs), mean over 50 after 5 warm-ups.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
TOKENS = (1, 16, 128, 2048, 8192)
BLOCK_CONFIGS = [  # block GEMM tiles tried per token count (the default of fp8_block_gemm.default_config is one)
    dict(BM=16, BN=32, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BM=16, BN=64, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BM=16, BN=128, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BM=64, BN=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BM=64, BN=128, GROUP_M=8, num_warps=4, num_stages=3),
    dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BM=128, BN=256, GROUP_M=8, num_warps=8, num_stages=3),
]


def graph_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Mean ms of `fn` captured once in a CUDA graph and replayed `iters` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def gemm_rows() -> list[dict]:
    from pdserve.engine.quant.fp8_block_gemm import block_gemm
    from pdserve.engine.quant.fp8_checkpoint import ONLINE_FP8, Fp8Scheme
    from pdserve.engine.quant.fp8_linear import Fp8Linear
    from pdserve.engine.quant.fp8_quant import quantize_activations, quantize_weight_blocks, quantize_weight_per_channel

    dev = torch.device("cuda")
    block = Fp8Scheme(weights="block", block_size=(128, 128), source="fp8")
    w = {p: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for p, (n, k) in SHAPES.items()}
    layers = {}
    for name, scheme, quant in (("channel", ONLINE_FP8, quantize_weight_per_channel), ("block", block, None)):
        for p, (n, k) in SHAPES.items():
            lin = Fp8Linear(k, n, False, scheme).to(dev)
            q, s = quant(w[p]) if quant else quantize_weight_blocks(w[p])
            lin.weight.copy_(q)
            lin.weight_scale.copy_(s)
            layers[name, p] = lin
    rows = []
    for m in TOKENS:
        x = {p: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for p, (n, k) in SHAPES.items()}
        flops = sum(2 * m * n * k for n, k in SHAPES.values())
        row: dict = {"tokens": m}
        row["bf16_ms"] = graph_ms(lambda: [F.linear(x[p], w[p]) for p in SHAPES])
        for name, rows in (("channel", 0), ("channel_triton", 1 << 30), ("block", 0)):
            for p in SHAPES:  # per channel: through _scaled_mm (0) or the Triton GEMM (every M)
                layers[name.split("_")[0], p].triton_max_rows = rows
            kind = name.split("_")[0]
            row[f"fp8_{name}_ms"] = graph_ms(lambda kind=kind: [layers[kind, p](x[p]) for p in SHAPES])
        best = None
        for cfg in BLOCK_CONFIGS:  # the block GEMM alone (activations quantized once, outside the timing)
            xq = {p: quantize_activations(x[p], 128) for p in SHAPES}
            try:
                ms = graph_ms(
                    lambda cfg=cfg: [
                        block_gemm(*xq[p], layers["block", p].weight, layers["block", p].weight_scale, config=cfg)
                        for p in SHAPES
                    ]
                )
            except Exception as e:  # a tile shape that does not fit shared memory: skip it
                print(f"  block config {cfg} at M={m}: {type(e).__name__}")
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is not None:
            row["fp8_block_gemm_best_ms"], row["fp8_block_best_config"] = best
        for key in ("bf16", "fp8_channel", "fp8_channel_triton", "fp8_block"):
            row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
        rows.append(row)
        print(
            f"M={m:5d}  bf16 {row['bf16_ms']:.3f} ms ({row['bf16_tflops']:.0f} TF/s)  fp8-channel scaled_mm "
            f"{row['fp8_channel_ms']:.3f} ({row['fp8_channel_tflops']:.0f}) triton {row['fp8_channel_triton_ms']:.3f}"
            f"  fp8-block {row['fp8_block_ms']:.3f} "
            f"({row['fp8_block_tflops']:.0f}; best tile {row.get('fp8_block_gemm_best_ms', float('nan')):.3f})"
        )
    return rows


def step_ms(model_dir: Path, batch: int, ctx: int, steps: int, **kw) -> float:
    """Mean wall ms of a decode step for `batch` sequences at about `ctx` tokens of context (int8 KV, graphs)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.request import EngineRequest
    from pdserve.engine.sampling import SamplingParams

    cfg = EngineConfig(model_dir=str(model_dir), kv_dtype="int8", max_num_seqs=max(batch, 8), **kw)
    engine = LLMEngine(cfg)
    sp = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(EngineRequest(f"r{i}", torch.randint(10, 1000, (ctx,), generator=g).tolist(), sp))
    while True:  # prefill everything, then a few decode steps of warm-up
        engine.step()
        if engine.last_step_scheduled and engine.last_step_prefill_tokens == 0:
            break
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    del engine
    torch.cuda.empty_cache()
    return ms


def decode_rows(layers: int, steps: int) -> dict:
    from pdserve.engine.quant.fp8_convert import convert_checkpoint
    from pdserve.models.random_llama import write_random_llama

    out: dict = {"layers": layers}
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bf16"
        write_random_llama(src, layers=layers, device="cuda")
        block = convert_checkpoint(src, Path(tmp) / "block", "block")
        for name, model_dir, kw in (
            ("bf16", src, {}),
            ("fp8_channel", src, {"quantization": "fp8"}),
            ("fp8_block", block, {}),
        ):
            out[f"itl_ms_b1_{name}"] = step_ms(model_dir, 1, 512, steps, **kw)
            out[f"step_ms_b128_{name}"] = step_ms(model_dir, 128, 2048, steps, **kw)
            print(f"{name:12s} ITL b1 ctx512 {out[f'itl_ms_b1_{name}']:.2f} ms   "
                  f"step b128 ctx2k {out[f'step_ms_b128_{name}']:.2f} ms  ({layers} layers)")  # fmt: skip
    return out


def run(layers: int = 8, steps: int = 32, out: str = "docs/bench/fp8_weights.json") -> dict:
    """Both benchmarks on the current CUDA device; returns (and writes) the JSON record."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gemm_8b_layer": gemm_rows(),
        "decode_8b_shape": decode_rows(layers, steps),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="8B-shaped layers in the decode checkpoint")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per configuration")
    ap.add_argument("--out", default="docs/bench/fp8_weights.json")
    args = ap.parse_args()
    run(args.layers, args.steps, args.out)
