"""FP8 weights (issue 30) on one GPU: GEMM throughput of the 8B projections in bf16, FP8 per channel (through
`torch._scaled_mm` and through the Triton GEMM) and FP8 block-scaled (Triton, plus a sweep of its tiles),
activation quantization included; engine decode step times (int8 KV) on a random 8B-shaped checkpoint in bf16,
online FP8 and a block-scaled FP8 copy; with --quality, perplexity of the demo model on the CPU. Prints a table,
writes docs/bench/fp8_weights.json.

    python bench/fp8_weights.py [--layers 8] [--steps 32] [--quality] [--out docs/bench/fp8_weights.json]

Weights are random (generated on the device, written as a bf16 checkpoint of `--layers` 8B layers; the block copy
is quantized from it on the CPU): the timings depend on shapes, not values. GEMM times are CUDA-graph replays of
the four projections of one layer (what a decode graph runs), mean over 50 after 5 warm-ups.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
TOKENS = (1, 16, 128, 2048, 8192)
TILES = ((16, 32), (16, 64), (16, 128), (64, 64), (64, 128), (128, 128), (128, 256))  # block GEMM (BM, BN) tried
BLOCK_CONFIGS = [
    dict(BM=bm, BN=bn, GROUP_M=1 if bm == 16 else 8, num_warps=8 if bm == 128 else 4, num_stages=3 if bn > 64 else 4)
    for bm, bn in TILES
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
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(warmup + iters):
        if i == warmup:
            start.record()
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
    schemes = {"channel": ONLINE_FP8, "block": Fp8Scheme(weights="block", block_size=(128, 128), source="fp8")}
    w = {p: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for p, (n, k) in SHAPES.items()}
    layers = {}
    for kind, scheme in schemes.items():
        for p, (n, k) in SHAPES.items():
            lin = layers[kind, p] = Fp8Linear(k, n, False, scheme).to(dev)
            q, s = quantize_weight_blocks(w[p]) if kind == "block" else quantize_weight_per_channel(w[p])
            lin.weight.copy_(q)
            lin.weight_scale.copy_(s)
    table = []
    for m in TOKENS:
        x = {p: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for p, (n, k) in SHAPES.items()}
        flops = sum(2 * m * n * k for n, k in SHAPES.values())
        row: dict = {"tokens": m, "bf16_ms": graph_ms(lambda: [F.linear(x[p], w[p]) for p in SHAPES])}
        for name, kind, triton_rows in (("channel", "channel", 0), ("channel_triton", "channel", 1 << 30),
                                        ("block", "block", 0)):  # fmt: skip
            for p in SHAPES:  # per channel: every M through _scaled_mm (0) or through the Triton GEMM
                layers[kind, p].triton_max_rows = triton_rows
            row[f"fp8_{name}_ms"] = graph_ms(lambda kind=kind: [layers[kind, p](x[p]) for p in SHAPES])
        xq = {p: quantize_activations(x[p], 128) for p in SHAPES}  # the block GEMM alone, per tile shape
        for cfg in BLOCK_CONFIGS:
            gemm = [(xq[p], layers["block", p]) for p in SHAPES]
            try:
                ms = graph_ms(lambda c=cfg, g=gemm: [block_gemm(*a, b.weight, b.weight_scale, config=c) for a, b in g])
            except Exception as e:  # a tile that does not fit shared memory: skip it
                print(f"  block tile {cfg} at M={m}: {type(e).__name__}")
                continue
            if ms < row.get("fp8_block_gemm_best_ms", math.inf):
                row["fp8_block_gemm_best_ms"], row["fp8_block_best_config"] = ms, cfg
        for key in ("bf16", "fp8_channel", "fp8_channel_triton", "fp8_block"):
            row[f"{key}_tflops"] = flops / row[f"{key}_ms"] / 1e9
        table.append(row)
        times = "  ".join(f"{k.removesuffix('_ms')} {v:.3f}" for k, v in row.items() if k.endswith("_ms"))
        print(f"M={m:5d} ms: {times}  (best block tile {row.get('fp8_block_best_config')})")
    return table


def step_ms(model_dir: Path, batch: int, ctx: int, steps: int, **kw) -> float:
    """Mean wall ms of a decode step for `batch` sequences at about `ctx` tokens of context (int8 KV, graphs)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.request import EngineRequest
    from pdserve.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), kv_dtype="int8", max_num_seqs=max(batch, 8), **kw))
    sp = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(EngineRequest(f"r{i}", torch.randint(10, 1000, (ctx,), generator=g).tolist(), sp))
    while not (engine.last_step_scheduled and engine.last_step_prefill_tokens == 0):  # prefill everything
        engine.step()
    for i in range(4 + steps):  # 4 warm-up decode steps, then the timed ones
        if i == 4:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    del engine
    gc.collect()  # the engine and its handoff refer to each other: free the pool before the next engine
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
        for name, model_dir, kw in (("bf16", src, {}), ("fp8_channel", src, {"quantization": "fp8"}),
                                    ("fp8_block", block, {})):  # fmt: skip
            b1, b128 = step_ms(model_dir, 1, 512, steps, **kw), step_ms(model_dir, 128, 2048, steps, **kw)
            out[f"itl_ms_b1_{name}"], out[f"step_ms_b128_{name}"] = b1, b128
            print(f"{name:12s} ITL b1 ctx512 {b1:.2f} ms, step b128 ctx2k {b128:.2f} ms ({layers} layers)")
    return out


def quality(seqs: int = 8, prompt: int = 64, forced: int = 192) -> dict:
    """Perplexity of SmolLM2-135M-Instruct (the demo model) on the shipped corpus, on the CPU through the
    dequantized path (fp32 math): its own weights, bf16 (weights and math), and FP8 block / per-channel copies."""
    from transformers import AutoTokenizer

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.quant.fp8_convert import convert_checkpoint
    from pdserve.models.demo import ensure_smol
    from pdserve.models.train_tiny import split_corpus
    from pdserve.testing.teacher_forcing import forced_logits

    path = ensure_smol()
    ids = AutoTokenizer.from_pretrained(str(path))("\n".join(split_corpus()))["input_ids"]
    wins = [ids[i * (len(ids) // seqs) :][: prompt + forced] for i in range(seqs)]
    target = torch.tensor([t for w in wins for t in w[prompt:]])
    out: dict = {"quality_model": path.name, "quality_scored_tokens": target.numel()}
    kw = dict(device="cpu", num_pages=seqs * (-(-(prompt + forced) // 16) + 1), max_num_seqs=seqs)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("fp32", "bf16", "fp8_block", "fp8_channel"):
            fmt = name.removeprefix("fp8_")
            model_dir = convert_checkpoint(path, Path(tmp) / fmt, fmt) if name.startswith("fp8") else path
            cfg = EngineConfig(model_dir=str(model_dir), dtype="bfloat16" if name == "bf16" else "float32", **kw)
            lg = torch.cat(forced_logits(LLMEngine(cfg), [w[:prompt] for w in wins], [w[prompt:] for w in wins]))
            out[f"ppl_{name}"] = math.exp(F.cross_entropy(lg.float(), target).item())
            print(f"ppl {name:12s} {out[f'ppl_{name}']:.4f} ({out[f'ppl_{name}'] / out['ppl_fp32']:.4f} x fp32)")
    return out


def run(layers: int = 8, steps: int = 32, with_quality: bool = False, out: str = "docs/bench/fp8_weights.json"):
    """The benchmarks on the current CUDA device (and the CPU, with_quality); returns and writes the record."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gemm_8b_layer": gemm_rows(),
        "decode_8b_shape": decode_rows(layers, steps),
        **(quality() if with_quality else {}),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="8B-shaped layers in the decode checkpoint")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per configuration")
    ap.add_argument("--quality", action="store_true", help="also the demo model's perplexity on the CPU")
    ap.add_argument("--out", default="docs/bench/fp8_weights.json")
    args = ap.parse_args()
    run(args.layers, args.steps, args.quality, args.out)
