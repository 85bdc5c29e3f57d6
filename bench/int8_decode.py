"""int8 decode attention on one Hopper GPU: the tile kernel (dequantize in registers) against the folded-scale
kernel (`fold_scales`: int8 -> bf16 conversion only, scales applied to scores and probabilities), per layer and
in the 8B-shaped engine at batch 128 / context 2k.

    python bench/int8_decode.py [--json docs/bench/int8_decode.json]

1. Per layer (Llama-3-8B: 8 KV heads, 32 query heads, head_dim 128, page 16), CUDA-graph timed, against fp32
   attention over the same dequantized pages: Triton int8 tile / expand / fold-scales variants (block 64/128,
   2/3 stages) and the Triton kernel on a bf16 pool, at (batch, context) (1, 512), (64, 2048), (128, 2048).
2. Engine (int8 KV, decode CUDA graphs, PDL): decode steps at batch 128 / context 2k with the tile kernel and
   with the fold-scales kernel, alternating A/B/A/B (re-captured each time), median step time; the roofline is
   weight + int8 KV bytes over the measured copy bandwidth.
Reuses bench/gpu_engine.py's checkpoint writer and timers; prints a table and writes the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_engine as ge

DEV = ge.DEV


def kernel_sweep(copy_bw: float) -> dict:
    from pdserve.engine.kernels import int8_decode_attention as kd
    from pdserve.kv import quant as Q

    ps, KVH, D, HQ = 16, 8, 128, 32
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    g = torch.Generator(device=DEV).manual_seed(21)
    variants = {
        f"{v}_bn{bn}_st{st}": dict(
            block_n=bn, num_stages=st, num_warps=4, scale_expand=v == "expand", fold_scales=v == "fold"
        )
        for v in ("tile", "expand", "fold")
        for bn in (64, 128)
        for st in (2, 3)
    }
    out: dict = {}
    for B, ctx in ((1, 512), (64, 2048), (128, 2048)):
        key, P = f"b{B}_ctx{ctx}", B * (ctx // ps)
        kv, q8, s8, table, lens, qq = ge.paged_decode_inputs(B, ctx, g, ps, KVH, D, HQ)
        pool = Q.dequantize(q8, s8, None, 64, torch.float32).view(2, P * ps, KVH, D)
        nb = min(B, 4)
        ref = ge.paged_attention_ref(qq[:nb], pool, table, ps)
        del pool
        splits = kd.default_num_splits(B, KVH, sms, 2)
        res = {}
        for name, c in variants.items():
            fn = lambda: kd.int8_paged_decode(
                qq,
                q8[0],
                q8[1],
                s8[0],
                s8[1],
                None,
                None,
                table,
                lens,
                D**-0.5,
                splits,
                **c,
            )
            err = ge.rel_err(fn()[:nb], ref)
            res[name] = (ge.graph_ms(fn) if err < 2e-2 else float("inf"), err)
        dense = lambda: kd.int8_paged_decode(
            qq,
            kv[0],
            kv[1],
            None,
            None,
            None,
            None,
            table,
            lens,
            D**-0.5,
            kd.default_num_splits(B, KVH, sms, 2),
            **{k: v for k, v in kd.DENSE_CONFIG.items() if k != "split_mult"},
        )
        res["dense_bf16"] = (ge.graph_ms(dense), 0.0)
        out[key] = res
        b_int8 = 2 * B * ctx * KVH * (D + 2 * 2)
        best = {
            v: min((k for k in variants if k.startswith(v)), key=lambda k: res[k][0])
            for v in ("tile", "expand", "fold")
        }
        ge.row(
            f"int8 decode attn/layer {key} (us)",
            " / ".join(f"{b} {res[b][0] * 1e3:.1f}" for b in best.values())
            + f" / dense-bf16 {res['dense_bf16'][0] * 1e3:.1f}",
            "BW vs copy: "
            + ", ".join(f"{v} {b_int8 / (res[b][0] * 1e-3) / copy_bw:.0%}" for v, b in best.items())
            + "; rel err "
            + ", ".join(f"{v} {res[b][1]:.1e}" for v, b in best.items()),
        )
        del kv, q8, s8
        ge.free_memory()
    return out


def engine_ab(model_dir: Path, fold_cfg: dict, copy_bw: float, weight_bytes: int) -> dict:

    e = ge.make_engine(model_dir, "int8", num_pages=18400)
    tile_cfg = {**e.runner.kernels.decode_config, "fold_scales": False}
    ge.fill_decode_batch(e, 128, 2048, torch.Generator().manual_seed(9))
    kv_token_bytes = e.runner.page_bytes() // e.page_size
    times: dict[str, list[float]] = {"tile": [], "fold": []}
    graph: dict[str, list[float]] = {"tile": [], "fold": []}
    for _ in range(2):
        for name, cfg in (("tile", tile_cfg), ("fold", fold_cfg)):
            e.runner.set_kernels(dataclasses.replace(e.runner.cfg, decode_kernel_config=json.dumps(cfg)))
            times[name] += ge.time_decode_steps(e, 12)[2:]
            graph[name].append(ge.cuda_ms(lambda: e.runner.graph_runner.graphs[128].replay(), reps=10))
    ctx = sum(s.num_tokens for s in e.scheduler.running) / 128
    roof = (weight_bytes + 128 * ctx * kv_token_bytes) / copy_bw * 1e3
    out = {"roofline_ms": roof, "mean_context": ctx, "tile_cfg": tile_cfg, "fold_cfg": fold_cfg}
    for name in times:
        t = statistics.median(times[name])
        out[name] = dict(step_ms=t, graph_ms=min(graph[name]), ratio=t / roof, tokens_per_s=128 / t * 1e3)
        ge.row(
            f"engine int8 decode b128 ctx2k, {name}",
            f"{t:.2f} ms/step ({128 / t * 1e3:.0f} tok/s)",
            f"graph {min(graph[name]):.2f} ms; roofline {roof:.2f} ms: ratio {t / roof:.2f}",
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="docs/bench/int8_decode.json")
    ap.add_argument("--model-dir", default="/dev/shm/llama3-8b-random")
    args = ap.parse_args()
    copy_bw, _ = ge.ceilings()
    sweep = kernel_sweep(copy_bw)
    b128 = sweep["b128_ctx2048"]
    fold_best = min((k for k in b128 if k.startswith("fold")), key=lambda k: b128[k][0])
    bn, st = int(fold_best.split("_bn")[1].split("_")[0]), int(fold_best.split("_st")[1])
    fold_cfg = dict(block_n=bn, num_warps=4, num_stages=st, split_mult=2, scale_expand=False, fold_scales=True)
    t0 = time.perf_counter()
    n_params = ge.write_checkpoint(Path(args.model_dir), 32)
    ge.log(f"checkpoint written in {time.perf_counter() - t0:.1f}s")
    engine = engine_ab(Path(args.model_dir), fold_cfg, copy_bw, n_params * 2)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": ge.git_commit(),
        "device": torch.cuda.get_device_name(DEV),
        "copy_bw": copy_bw,
        "kernel_ms_err": sweep,
        "engine_b128": engine,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    ge.print_rows()


if __name__ == "__main__":
    sys.exit(main())
