"""GPU engine on one Hopper GPU: checks and times everything issue 6 asks for, in one process.

    python bench/gpu_engine.py [--model-dir DIR] [--layers 32] [--json docs/bench/gpu_engine.json]

1. Ceilings measured here: device copy bandwidth (bytes read + written) and an 8192^3 bf16 matmul.
2. A Llama-3-8B-shaped checkpoint (hidden 4096, 32 layers, 32 heads / 8 KV heads, ffn 14336, vocab 128256) with
   random bf16 weights, written as a real HF checkpoint (sharded safetensors + index + tokenizer) into --model-dir
   and loaded by both HF transformers and the engine's normal loader.
3. HF transformers baseline (bf16, its default SDPA attention): monolithic prefill of 8192 tokens and `generate`
   inter-token latency at batch 1 (prompt 512); HF fp32 as the reference: greedy 64 prompts x 64 tokens and
   teacher-forced logits; HF bf16 against it as the yardstick.
4. Kernels on fresh random inputs, against references: int8 quantize/dequantize (bit-equal to the CPU torch
   path, bandwidth vs copy), decode attention (FA3 bf16 paged, Triton int8 direct, dequantize + FA3), FA3 prefill
   paged vs contiguous, decode GEMVs.
5. The engine (FA3, fused kernels, decode CUDA graphs), dense bf16 KV then int8 KV: teacher-forced logits and
   greedy match vs HF fp32; 8k-token chunked prefill (chunk 2048); ITL at batch 1 / context 512; decode steps at
   batch 128 and 64 / context 2k against the weight + KV bytes roofline; int8 decode kernel "triton" vs "dequant";
   KV capacity at context 4k.

FLOPs of a prefill (the issue's count): 2 * params * tokens + attention 2 * T^2 * head_dim * heads * layers
(causal: half of QK^T and PV). Decode roofline: (all weight bytes + KV bytes read) / measured copy bandwidth.
Prints a table and writes the JSON (keys of issue 6 + details).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from benchutil import log, print_rows, row  # bench/ is on sys.path: the script's folder (also ge.log, ge.row)

from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import GRAPH_BACKENDS
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_cache import Int8KVCache, KVCache
from pdserve.engine.sampling import SamplingParams
from pdserve.models.random_llama import LLAMA3_8B_SHAPE, write_random_llama
from pdserve.testing.provenance import git_commit
from pdserve.testing.teacher_forcing import forced_logits as teacher_forced_logits

SHAPE = LLAMA3_8B_SHAPE
DEV = torch.device("cuda")
RESULTS: dict = {}


def cuda_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---- 1. ceilings ----------------------------------------------------------------------------------------
def ceilings() -> tuple[float, float]:
    x = torch.randn(1 << 30, device=DEV, dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    ms = cuda_ms(lambda: y.copy_(x), reps=20)
    copy_bw = 2 * x.numel() * 2 / (ms * 1e-3)
    del x, y
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = cuda_ms(lambda: a @ b, reps=20)
    mm = 2 * 8192**3 / (ms * 1e-3)
    del a, b
    free_memory()
    row("copy bandwidth (read+write)", f"{copy_bw / 1e12:.2f} TB/s", "device-to-device copy of 2 GiB")
    row("bf16 matmul 8192^3", f"{mm / 1e12:.0f} TFLOP/s", "random data")
    return copy_bw, mm


# ---- 2. checkpoint --------------------------------------------------------------------------------------
def write_checkpoint(out: Path, layers: int, seed: int = 0) -> int:
    """Random bf16 Llama-3-8B-shaped checkpoint (HF layout). Returns the parameter count."""
    return write_random_llama(out, layers, seed, DEV, SHAPE)


def prefill_flops(n_params: int, tokens: int, layers: int) -> float:
    attn = 2 * tokens**2 * SHAPE["head_dim"] * SHAPE["num_attention_heads"] * layers
    return 2 * n_params * tokens + attn


# ---- 3. HF transformers ---------------------------------------------------------------------------------
def hf_section(model_dir: Path, n_params: int, layers: int, prompts: torch.Tensor, gen_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, device_map="cuda").eval()
    log(f"HF load {time.perf_counter() - t0:.1f}s, attn_implementation={m.config._attn_implementation}")
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    g = torch.Generator(device=DEV).manual_seed(7)
    out: dict = {}
    with torch.inference_mode():
        ids = torch.randint(5, SHAPE["vocab_size"], (1, 8192), device=DEV, generator=g)
        ms = cuda_ms(lambda: m(ids, logits_to_keep=1), reps=3, warmup=1)
        out["prefill_ms"] = ms
        out["prefill_tflops"] = prefill_flops(n_params, 8192, layers) / (ms * 1e-3) / 1e12
        row("HF prefill 8k (bf16, monolithic)", f"{out['prefill_tflops']:.0f} TFLOP/s", f"{ms:.1f} ms")
        p512 = torch.randint(5, SHAPE["vocab_size"], (1, 512), device=DEV, generator=g)
        gen = lambda n: m.generate(
            p512,
            attention_mask=torch.ones_like(p512),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
        gen(4)
        times = {}
        for n in (1, 33):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gen(n)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t0
        out["itl_ms"] = (times[33] - times[1]) / 32 * 1e3
        row("HF generate ITL b1 ctx512", f"{out['itl_ms']:.2f} ms", "(t(33 tokens) - t(1)) / 32")
        free_memory()
        mask = torch.ones_like(prompts)
        out["greedy_bf16"] = m.generate(
            prompts, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False
        )[:, prompts.shape[1] :].cpu()
        m.float()
        free_memory()
        out["greedy_fp32"] = m.generate(
            prompts, attention_mask=mask, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False
        )[:, prompts.shape[1] :].cpu()
        full = torch.cat([prompts, out["greedy_fp32"].to(DEV)], 1)[:, :-1]
        ref = torch.cat([m(full[i : i + 8], logits_to_keep=gen_len).logits.float() for i in range(0, len(full), 8)])
        m.to(torch.bfloat16)
        free_memory()
        bf = torch.cat([m(full[i : i + 8], logits_to_keep=gen_len).logits.float() for i in range(0, len(full), 8)])
        out["logits_fp32"] = ref  # [N, gen_len, V] on the GPU
        out["bf16_logit_err"] = rel_err(bf, ref)
        out["bf16_logit_maxabs"] = (bf - ref).abs().max().item()
        del bf
    del m
    free_memory()
    row("HF bf16 vs HF fp32 logits", f"{out['bf16_logit_err']:.2e}", f"rel L2; max abs {out['bf16_logit_maxabs']:.3f}")
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def greedy_stats(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Exact-match rate of whole continuations, first divergence per prompt (len = none)."""
    n, L = ref.shape
    first = []
    for i in range(n):
        diff = (ours[i] != ref[i]).nonzero()
        first.append(int(diff[0]) if len(diff) else L)
    return {
        "exact_match_rate": sum(f == L for f in first) / n,
        "first_divergence": first,
        "mean_tokens_before_divergence": sum(first) / n,
    }


# ---- 4. kernels -----------------------------------------------------------------------------------------
def graph_ms(fn, reps: int = 30) -> float:
    """Median ms per call of fn replayed from a CUDA graph (no launch overhead: what a decode graph pays)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay, reps=reps)


def first(out):
    return out[0] if isinstance(out, tuple) else out


def fa3_paged(fa, q: torch.Tensor, kv, lens: torch.Tensor, table: torch.Tensor, **kw) -> torch.Tensor:
    """FA3's paged attention of q over the bf16 pages kv[0] / kv[1] [P, ps, KVH, D] (its output, not the LSE)."""
    return first(fa.flash_attn_with_kvcache(q, kv[0], kv[1], cache_seqlens=lens, page_table=table, **kw))


def paged_decode_inputs(B: int, ctx: int, g: torch.Generator, ps: int = 16, kvh: int = 8, d: int = 128, hq: int = 32):
    """Random inputs of one layer's decode attention at batch B, context ctx (Llama-3-8B heads by default): a bf16
    pool kv [2, P, ps, KVH, D] (P = B * ctx / ps pages), its int8 quantization q8 / s8 (group 64), a shuffled page
    table [B, ctx / ps] int32, seqlens [B] int32 (all ctx) and queries qq [B, HQ, D] bf16."""
    from pdserve.kv import quant as Q

    W = ctx // ps
    P = B * W
    kv = torch.randn(2, P, ps, kvh, d, device=DEV, generator=g).bfloat16()
    q8, s8, _ = Q.quantize(kv, 64, False)
    table = torch.randperm(P, device=DEV, generator=g).int().view(B, W)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    qq = torch.randn(B, hq, d, device=DEV, generator=g).bfloat16()
    return kv, q8, s8, table, lens, qq


def paged_attention_ref(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, ps: int) -> torch.Tensor:
    """fp64 decode attention of q [n, HQ, D] (sequence i: every slot of its page-table row table[i]) over a dense
    pool [2, slots, KVH, D] -> [n, HQ, D]."""
    n, hq, d = q.shape
    out = torch.empty(n, hq, d, device=q.device, dtype=torch.float64)
    for i in range(n):
        slots = (table[i].long()[:, None] * ps + torch.arange(ps, device=q.device)).flatten()
        kk = pool[0, slots].double().repeat_interleave(hq // pool.shape[2], 1)
        vv = pool[1, slots].double().repeat_interleave(hq // pool.shape[2], 1)
        a = torch.einsum("hd,nhd->hn", q[i].double(), kk) * d**-0.5
        out[i] = torch.einsum("hn,nhd->hd", a.softmax(-1), vv)
    return out


def kernel_section(copy_bw: float) -> dict:
    import flash_attn_interface as fa

    from pdserve.engine.kernels import int8_decode_attention as kd
    from pdserve.engine.kernels import kv_quant
    from pdserve.engine.kernels.kv_gather import dequant_pages
    from pdserve.kv import quant as Q

    out: dict = {}
    g = torch.Generator(device=DEV).manual_seed(11)
    # quantize / dequantize: bitwise vs the CPU torch path, error vs fp32, bandwidth (sweep of the launch config)
    for asym in (False, True):
        x = torch.randn(4096, 8, 128, device=DEV, generator=g).bfloat16() * 3
        q, s, z = kv_quant.quantize(x, 64, asym, fast_div=False)
        qc, sc, zc = Q.quantize(x.cpu(), 64, asym)
        same = torch.equal(q.cpu(), qc) and torch.equal(s.cpu(), sc) and (z is None or torch.equal(z.cpu(), zc))
        d = kv_quant.dequantize(q, s, z, 64, torch.bfloat16)
        same_d = torch.equal(d.cpu(), Q.dequantize(qc, sc, zc, 64, torch.bfloat16))
        err = rel_err(kv_quant.dequantize(q, s, z, 64, torch.float32), x.float())
        out[f"quant_bitwise_{'asym' if asym else 'sym'}"] = same and same_d
        row(f"int8 {'asym' if asym else 'sym'} g64 == CPU path", str(same and same_d), f"rel err vs exact {err:.2e}")
    x = torch.randn(1 << 21, 128, device=DEV, generator=g).bfloat16() * 4  # 512 MiB bf16
    n = x.numel()
    q, s, z = kv_quant.quantize(x, 64, False, fast_div=False)  # div_rn: bit-equal to the CPU path (above)
    xa = torch.randn(1 << 18, 128, device=DEV, generator=g) * 3 + 1  # asymmetric, float32
    qa, sa, za = kv_quant.quantize(xa, 64, True, fast_div=False)
    qf, sf, _ = kv_quant.quantize(x, 64, False, fast_div=True)
    qfa, sfa, zfa = kv_quant.quantize(xa, 64, True, fast_div=True)
    fast_exact = bool(
        torch.equal(qf, q)
        and torch.equal(sf, s)
        and torch.equal(qfa, qa)
        and torch.equal(sfa, sa)
        and torch.equal(zfa, za)
    )
    out["fast_div_bit_equal"] = fast_exact
    row("quantize fast division == div_rn", str(fast_exact), f"{n + xa.numel():,} elements, sym bf16 + asym fp32")
    del qf, sf, qfa, sfa, zfa, xa, qa, sa, za
    sweep = {}
    for fast in (False, True) if fast_exact else (False,):
        for br in (16, 32, 64, 128):
            for nw in (4, 8):
                tq = cuda_ms(lambda: kv_quant.quantize(x, 64, False, br, nw, fast))
                td = cuda_ms(lambda: kv_quant.dequantize(q, s, None, 64, torch.bfloat16, br, nw))
                sweep[f"{br}x{nw}{'-fast' if fast else ''}"] = (tq, td)
    best_q = min(sweep, key=lambda k: sweep[k][0])
    best_d = min(sweep, key=lambda k: sweep[k][1])
    tq, td = sweep[best_q][0], sweep[best_d][1]
    bq = (2 * n + n + 2 * n // 64) / (tq * 1e-3)
    bd = (n + 2 * n // 64 + 2 * n) / (td * 1e-3)
    out.update(
        quant_bw=bq,
        dequant_bw=bd,
        quant_bw_fraction=min(bq, bd) / copy_bw,
        quant_sweep_ms=sweep,
        quant_best=best_q,
        dequant_best=best_d,
    )
    dflt = f"{kv_quant.BLOCK_R}x{kv_quant.NUM_WARPS}{'-fast' if kv_quant.FAST_DIV else ''}"
    row(
        "quantize bf16->int8 g64",
        f"{bq / 1e12:.2f} TB/s",
        f"{bq / copy_bw:.0%} of copy (rows x warps {best_q}; code default {dflt}: {sweep[dflt][0]:.3f} ms vs {tq:.3f})",
    )
    row("dequantize int8->bf16 g64", f"{bd / 1e12:.2f} TB/s", f"{bd / copy_bw:.0%} of copy (rows x warps {best_d})")
    del x, q, s
    free_memory()

    # decode attention, one layer of Llama-3-8B (graph-timed): FA3 bf16 paged, Triton (int8 / dense), dequant+FA3
    ps, KVH, D, HQ = 16, 8, 128, 32
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    shapes = ((1, 512), (64, 2048), (128, 2048))
    kcfgs = [dict(block_n=bn, num_warps=4, num_stages=st) for bn in (64, 128) for st in (2, 3)]
    times: dict = {"triton_int8": {}, "triton_dense": {}, "fa3": {}, "dequant_fa3": {}}
    cfg_of: dict = {}  # config name -> kernel kwargs (+ split_mult)
    for B, ctx in shapes:
        W = ctx // ps
        P = B * W
        key = f"b{B}_ctx{ctx}"
        kv, q8, s8, table, lens, qq = paged_decode_inputs(B, ctx, g, ps, KVH, D, HQ)
        # fp32 references (dequantized pages for int8; the bf16 pages for dense) on the first sequences
        nb = min(B, 4)
        ref8 = Q.dequantize(q8, s8, None, 64, torch.float32).view(2, P * ps, KVH, D)
        refs = {
            name: paged_attention_ref(qq[:nb], pool, table, ps)
            for name, pool in (("int8", ref8), ("dense", kv.view(2, P * ps, KVH, D)))
        }
        del ref8
        for sm in (1, 2):
            splits = kd.default_num_splits(B, KVH, sms, sm)
            int8_variants = ((False, False), (True, False), (False, True))  # (scale_expand, fold_scales)
            for c0, (ex, fd), mode, args in [
                (c0, v, "triton_int8", (q8[0], q8[1], s8[0], s8[1])) for c0 in kcfgs for v in int8_variants
            ] + [(c0, (False, False), "triton_dense", (kv[0], kv[1], None, None)) for c0 in kcfgs]:
                c = dict(c0, scale_expand=ex, fold_scales=fd)
                ck = f"bn{c['block_n']}_st{c['num_stages']}_sm{sm}_ex{int(ex)}" + ("_fold" if fd else "")
                cfg_of[ck] = dict(c, split_mult=sm)
                fn = lambda: kd.int8_paged_decode(qq, *args, None, None, table, lens, D**-0.5, splits, **c)
                try:
                    e = rel_err(fn()[:nb], refs["int8" if mode == "triton_int8" else "dense"])
                    res = (graph_ms(fn), e) if e < 2e-2 else (float("inf"), e)  # a wrong config never wins
                except Exception as err:
                    log(f"{mode} {ck} {key}: {type(err).__name__}")
                    res = (float("inf"), float("nan"))
                times[mode].setdefault(ck, {})[key] = res
        for ns in (0, 4):
            fn = lambda: fa3_paged(fa, qq.unsqueeze(1), kv, lens, table, causal=True, num_splits=ns)
            times["fa3"].setdefault(f"splits{ns}", {})[key] = (
                graph_ms(fn),
                rel_err(fn().squeeze(1)[:nb], refs["dense"]),
            )

        def deq():
            sc = dequant_pages(q8, s8, None, table, lens, torch.bfloat16)
            t2 = torch.arange(B * W, dtype=torch.int32, device=DEV).view(B, W)
            pages = (sc[0].view(P, ps, KVH, D), sc[1].view(P, ps, KVH, D))
            return fa3_paged(fa, qq.unsqueeze(1), pages, lens, t2, causal=True)

        times["dequant_fa3"].setdefault("default", {})[key] = (
            graph_ms(deq),
            rel_err(deq().squeeze(1)[:nb], refs["int8"]),
        )
        del kv, q8, s8
        free_memory()

    def best(mode: str) -> tuple[str, dict]:
        """The config with the smallest sum over shapes of time / best time at that shape."""
        per = times[mode]
        mins = {k: min(v[k][0] for v in per.values()) for k in next(iter(per.values()))}
        name = min(per, key=lambda c: sum(per[c][k][0] / mins[k] for k in mins))
        return name, per[name]

    out["decode_attn_sweep"] = times
    chosen = {m: best(m) for m in times}
    out["decode_attn_best"] = {m: c for m, (c, _) in chosen.items()}
    out["decode_attn_configs"] = cfg_of
    for B, ctx in shapes:
        key = f"b{B}_ctx{ctx}"
        tt = {m: chosen[m][1][key] for m in chosen}
        b_dense, b_int8 = 2 * B * ctx * KVH * D * 2, 2 * B * ctx * KVH * (D + 2 * 2)
        row(
            f"decode attn/layer {key} (graph-timed, us)",
            " / ".join(f"{m} {tt[m][0] * 1e3:.1f}" for m in tt),
            f"BW vs copy: fa3 {b_dense / (tt['fa3'][0] * 1e-3) / copy_bw:.0%}, triton-int8 "
            f"{b_int8 / (tt['triton_int8'][0] * 1e-3) / copy_bw:.0%}, triton-dense "
            f"{b_dense / (tt['triton_dense'][0] * 1e-3) / copy_bw:.0%}; rel err "
            + ", ".join(f"{m} {tt[m][1]:.1e}" for m in tt),
        )
    row("decode attn configs chosen", ", ".join(f"{m}: {c}" for m, (c, _) in chosen.items()), "min of sum t/t_best")

    # prefill attention: last 2048-query chunk of an 8k prompt, paged (ps 16) vs contiguous varlen
    T, K = 2048, 8192
    kv = torch.randn(2, K // ps, ps, KVH, D, device=DEV, generator=g).bfloat16()
    qq = torch.randn(T, HQ, D, device=DEV, generator=g).bfloat16()
    table = torch.arange(K // ps, dtype=torch.int32, device=DEV).view(1, -1)
    lens = torch.tensor([K], dtype=torch.int32, device=DEV)
    cu_q = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, K], dtype=torch.int32, device=DEV)
    paged = lambda: fa3_paged(fa, qq, kv, lens, table, cu_seqlens_q=cu_q, max_seqlen_q=T, causal=True)
    flat = lambda: first(
        fa.flash_attn_varlen_func(
            qq,
            kv[0].view(K, KVH, D),
            kv[1].view(K, KVH, D),
            cu_q,
            cu_k,
            T,
            K,
            causal=True,
        )
    )
    flops = 4 * T * (K - T / 2) * D * HQ
    tp, tf = cuda_ms(paged), cuda_ms(flat)
    out["prefill_attn"] = dict(
        paged_ms=tp,
        varlen_ms=tf,
        paged_tflops=flops / tp / 1e9,
        varlen_tflops=flops / tf / 1e9,
        paged_vs_varlen_err=rel_err(paged(), flat()),
    )
    row(
        "FA3 prefill attn q2048 k8192",
        f"paged {flops / tp / 1e9:.0f} TFLOP/s, varlen {flops / tf / 1e9:.0f} TFLOP/s",
        f"outputs agree {out['prefill_attn']['paged_vs_varlen_err']:.1e}",
    )
    del kv
    free_memory()

    # decode GEMVs at M = 1 (graph-timed): cuBLAS vs the Triton GEMV (kernels/gemv.py), per projection; `down`
    # is timed with SwiGLU: the Triton GEMV applies it while loading, cuBLAS needs the silu_mul kernel first
    from pdserve.engine.kernels.gemv import gemv
    from pdserve.engine.kernels.silu_mul import silu_mul

    h, ffn = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    gcfgs = {
        f"bn{bn}_bk{bk}_st{st}": dict(block_n=bn, block_k=bk, num_warps=4, num_stages=st)
        for bn, bk, st in (
            (8, 512, 3),
            (16, 512, 3),
            (16, 256, 4),
            (16, 1024, 2),
            (8, 1024, 2),
            (32, 1024, 2),
            (16, 2048, 2),
            (8, 2048, 2),
        )
    }
    gt: dict = {"cublas": {}, **{k: {} for k in gcfgs}}
    for name, (n_out, n_in) in {"qkv": (6144, h), "o": (h, h), "gate_up": (2 * ffn, h), "down": (h, ffn)}.items():
        w = torch.randn(n_out, n_in, device=DEV, generator=g).bfloat16()
        act = "silu_mul" if name == "down" else None
        xx = torch.randn(4, 2 * n_in if act else n_in, device=DEV, generator=g).bfloat16()
        xin = silu_mul(xx) if act else xx  # what the projection multiplies
        ref = xin.double() @ w.double().T
        gt["cublas"][name] = graph_ms(lambda: torch.nn.functional.linear(silu_mul(xx[:1]) if act else xx[:1], w))
        for k, c in gcfgs.items():
            try:
                ok = all(rel_err(gemv(xx[:m], w, None, act=act, **c), ref[:m]) < 1e-2 for m in (1, 3, 4))
                ok = ok and (not act or torch.equal(gemv(xx[:2], w, None, act=act, **c), gemv(xin[:2], w, None, **c)))
                gt[k][name] = graph_ms(lambda: gemv(xx[:1], w, None, act=act, **c)) if ok else float("inf")
            except Exception as ex:
                log(f"gemv {k} {name}: {type(ex).__name__}")
                gt[k][name] = float("inf")
        bk = min(gcfgs, key=lambda k: gt[k][name])
        row(
            f"GEMV M=1 {name} [{n_out}x{n_in}]" + (" + SwiGLU" if act else ""),
            f"cuBLAS {gt['cublas'][name] * 1e3:.1f} us, Triton {bk} {gt[bk][name] * 1e3:.1f} us",
            f"cuBLAS {w.numel() * 2 / (gt['cublas'][name] * 1e-3) / copy_bw:.0%} of copy BW, Triton "
            f"{w.numel() * 2 / (gt[bk][name] * 1e-3) / copy_bw:.0%}",
        )
        del w
    choice, triton_best = {}, {}
    for name in gt["cublas"]:
        bk = min(gcfgs, key=lambda k: gt[k][name])
        triton_best[name] = gcfgs[bk]
        choice[name] = gcfgs[bk] if gt[bk][name] < gt["cublas"][name] else None
    out["gemv_triton_best"] = triton_best  # the engine also times this plan in the whole step (PDL chains)
    per_layer = sum(gt[min(gcfgs, key=lambda k: gt[k][n])][n] if choice[n] else gt["cublas"][n] for n in choice)
    out["gemv_sweep_ms"] = gt
    out["gemv_choice"] = choice
    row(
        "decode GEMVs per layer (M=1)",
        f"cuBLAS {sum(gt['cublas'].values()) * 1e3:.1f} us, chosen {per_layer * 1e3:.1f} us",
        "Triton for " + (", ".join(n for n in choice if choice[n]) or "none"),
    )
    free_memory()
    return out


def decode_choice(kern: dict) -> dict:
    """Backend settings from the kernel sweeps: the Triton config, FA3 splits, and whether the Triton kernel
    beats FA3 on the dense pool (sum over the three decode shapes)."""
    chosen = kern["decode_attn_best"]
    parse = kern["decode_attn_configs"].get
    sw = kern["decode_attn_sweep"]
    total = lambda mode, c: sum(t for t, _ in sw[mode][c].values())
    return dict(
        int8_config=parse(chosen["triton_int8"]),
        dense_config=parse(chosen["triton_dense"]),
        fa3_num_splits=int(chosen["fa3"][6:]),
        dense_decode="triton" if total("triton_dense", chosen["triton_dense"]) < total("fa3", chosen["fa3"]) else "fa3",
        small_m_gemv=kern.get("gemv_choice"),
        small_m_gemv_triton=kern.get("gemv_triton_best"),
    )


# ---- 5. engine ------------------------------------------------------------------------------------------
def make_engine(model_dir: Path, kv: str, num_pages: int, **kw) -> LLMEngine:
    t0 = time.perf_counter()
    e = LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype="bfloat16",
            device="cuda",
            page_size=16,
            chunk_size=2048,
            num_pages=num_pages,
            max_num_seqs=128,
            kv_dtype=kv,
            attention_backend="fa3",
            **kw,
        )
    )
    r = e.runner
    assert r.kernels.fused and r.backend.name in GRAPH_BACKENDS and r.graph_runner is not None
    log(f"engine kv={kv}: load + graph capture {time.perf_counter() - t0:.1f}s")
    return e


def forced_logits(e: LLMEngine, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """[prompts, steps, V] teacher-forced logits (all continuations have one length here)."""
    return torch.stack(teacher_forced_logits(e, prompts, forced))


def time_prefill(e: LLMEngine, ids: list[int] | Callable[[], list[int]], reps: int = 3) -> float:
    """Median wall ms from add_request to the first token (4 chunked steps of 2048 for 8192 tokens) over `reps`
    runs after a warm-up run; `ids`: the prompt, or a function making a fresh one for each run."""
    times = []
    for r in range(reps + 1):
        prompt = ids() if callable(ids) else ids
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e.add_request(f"pf{r}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while e.has_unfinished_requests():
            e.step()
        torch.cuda.synchronize()
        if r:  # the first run warms up
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fill_decode_batch(e: LLMEngine, batch: int, ctx: int, g: torch.Generator) -> None:
    """`batch` greedy requests of `ctx` random prompt tokens ("d0".. ; at most 4000 new tokens each), stepped until
    every one is prefilled and decoding."""
    sp = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        e.add_request(f"d{i}", torch.randint(5, SHAPE["vocab_size"], (ctx,), generator=g).tolist(), sp)
    while len(e.scheduler.running) < batch or e.scheduler.waiting:
        e.step()


def time_decode_steps(e: LLMEngine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        e.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def host_profile(e: LLMEngine, steps: int) -> str:
    """cProfile of `steps` decode steps (tottime), logged and returned."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    time_decode_steps(e, steps)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    log(f"host profile of {steps} decode steps at b{len(e.scheduler.running)} (tottime):\n" + buf.getvalue()[-2500:])
    return buf.getvalue()


def decode_section(e: LLMEngine, tag: str, copy_bw: float, weight_bytes: int, kv_token_bytes: int, g) -> dict:
    """ITL at batch 1 / ctx 512, then batch 128 and 64 at ctx 2k; graph replay time beside each engine step."""
    out: dict = {}
    V = SHAPE["vocab_size"]
    sp = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    runner = e.runner.graph_runner
    e.add_request("itl", torch.randint(5, V, (512,), generator=g).tolist(), sp)
    e.step()  # prefill
    steps = time_decode_steps(e, 160)[10:]
    out["itl_ms"] = statistics.median(steps)
    out["itl_ms_p10_p90"] = (statistics.quantiles(steps, n=10)[0], statistics.quantiles(steps, n=10)[-1])
    roof = (weight_bytes + 597 * kv_token_bytes) / copy_bw * 1e3  # mean context of the 150 timed steps
    out["itl_roofline_ms"] = roof
    row(
        f"[{tag}] ITL b1 ctx512",
        f"{out['itl_ms']:.2f} ms",
        f"median of 150 steps (p10 {out['itl_ms_p10_p90'][0]:.2f}, "
        f"p90 {out['itl_ms_p10_p90'][1]:.2f}); roofline {roof:.2f} ms, ratio {out['itl_ms'] / roof:.2f}",
    )
    out["graph_b1_ms"] = cuda_ms(lambda: runner.graphs[1].replay(), reps=20)
    row(f"[{tag}] graph replay b1", f"{out['graph_b1_ms']:.2f} ms", "GPU time of the captured step (no Python)")
    out["host_profile_b1"] = host_profile(e, 20)
    if e.runner.kernels.pdl:  # the same steps without programmatic dependent launch (re-captured), then back
        with_pdl = e.runner.cfg
        e.runner.set_kernels(dataclasses.replace(with_pdl, pdl=False))
        out["itl_ms_no_pdl"] = statistics.median(time_decode_steps(e, 160)[10:])
        out["graph_b1_ms_no_pdl"] = cuda_ms(lambda: runner.graphs[1].replay(), reps=20)
        e.runner.set_kernels(with_pdl)
        out["itl_ms_pdl_again"] = statistics.median(time_decode_steps(e, 160)[10:])
        row(
            f"[{tag}] ITL b1 without PDL",
            f"{out['itl_ms_no_pdl']:.2f} ms",
            f"graph {out['graph_b1_ms_no_pdl']:.2f} ms vs {out['graph_b1_ms']:.2f} with PDL; "
            f"with PDL again {out['itl_ms_pdl_again']:.2f} ms",
        )
    e.abort("itl")
    e.step()
    t0 = time.perf_counter()
    fill_decode_batch(e, 128, 2048, g)
    log(f"[{tag}] 128 x 2048 prefilled in {time.perf_counter() - t0:.1f}s")
    for B in (128, 64):
        if B == 64:
            for i in range(64, 128):
                e.abort(f"d{i}")
            e.step()
        ctx = sum(s.num_tokens for s in e.scheduler.running) / B + 15  # mean context over the timed steps
        steps = time_decode_steps(e, 25)[5:]
        t = statistics.median(steps)
        roof = (weight_bytes + B * ctx * kv_token_bytes) / copy_bw * 1e3
        gpu = cuda_ms(lambda: runner.graphs[B].replay(), reps=10)
        out[f"b{B}"] = dict(
            step_ms=t,
            graph_ms=gpu,
            roofline_ms=roof,
            ratio=t / roof,
            graph_ratio=gpu / roof,
            tokens_per_s=B / t * 1e3,
            mean_context=ctx,
        )
        row(
            f"[{tag}] decode b{B} ctx2k step",
            f"{t:.2f} ms ({B / t * 1e3:.0f} tok/s)",
            f"roofline {roof:.2f} ms: ratio {t / roof:.2f} (graph replay alone {gpu:.2f} ms, {gpu / roof:.2f})",
        )
        if B == 128:  # where the host time of a step goes
            out["host_profile_b128"] = host_profile(e, 5)
    for i in range(64):
        e.abort(f"d{i}")
    e.step()
    return out


def profile_decode(e: LLMEngine, tag: str) -> list:
    """Top CUDA kernels of 3 graph replays at batch 1 (where the ITL goes)."""
    from torch.profiler import ProfilerActivity, profile

    runner = e.runner.graph_runner
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            runner.graphs[1].replay()
        torch.cuda.synchronize()
    top = []
    for ev in sorted(prof.key_averages(), key=lambda x: -x.device_time_total)[:14]:
        top.append((ev.key[:70], round(ev.device_time_total / 3, 1), ev.count // 3))
    log(f"[{tag}] top kernels per b1 step (us, count): " + "; ".join(f"{k} {t} x{c}" for k, t, c in top))
    return top


def choose_gemv_plan(e: LLMEngine, choice: dict) -> dict:
    """Per-projection GEMV choices timed kernel by kernel can mislead inside a PDL chain (cuBLAS kernels do not
    overlap their launch with the previous kernel): time the whole b1 graph with the isolated winners and with
    Triton everywhere (alternating, best of 3 each), keep the faster; returns the timings."""
    plans = {"isolated": choice["small_m_gemv"] or {}, "triton": choice["small_m_gemv_triton"]}
    times: dict[str, list[float]] = {k: [] for k in plans}
    for _ in range(3):
        for name, plan in plans.items():
            e.runner.set_kernels(dataclasses.replace(e.runner.cfg, gemv_plan=json.dumps(plan)))
            times[name].append(cuda_ms(lambda: e.runner.graph_runner.graphs[1].replay(), reps=30))
    best = min(plans, key=lambda k: min(times[k]))
    e.runner.set_kernels(dataclasses.replace(e.runner.cfg, gemv_plan=json.dumps(plans[best])))
    row("GEMV plan by b1 graph time", best, ", ".join(f"{k} {min(v):.3f} ms" for k, v in times.items()))
    return {"times": times, "chosen": best, "plan": plans[best]}


def engine_section(model_dir: Path, kv: str, ctx: dict) -> dict:
    g = torch.Generator().manual_seed(5 if kv == "auto" else 6)
    out: dict = {}
    e = make_engine(model_dir, kv, num_pages=18400)
    choice = ctx.get("decode_choice")
    if choice:  # the kernel sweeps' winners (bench/gpu_engine.py kernel_section), then re-capture the graphs
        e.runner.set_kernels(
            dataclasses.replace(
                e.runner.cfg,
                decode_kernel_config=json.dumps(choice["int8_config" if kv == "int8" else "dense_config"]),
                dense_decode_kernel=choice["dense_decode"],
                fa3_num_splits=choice["fa3_num_splits"],
                gemv_plan=json.dumps(ctx.get("gemv_plan") or choice["small_m_gemv"] or {}),
            )
        )
        if "gemv_plan" not in ctx and choice.get("small_m_gemv_triton"):
            out["gemv_plans_b1_graph_ms"] = choose_gemv_plan(e, choice)
            ctx["gemv_plan"] = e.runner.kernels.gemv  # the int8 engine uses the same
        kc = e.runner.kernels
        out["decode_settings"] = dict(
            decode_config=kc.decode_config,
            dense_decode=kc.dense_decode,
            fa3_num_splits=kc.fa3_num_splits,
            small_m_gemv=kc.gemv,
            pdl=kc.pdl,
        )
    mc = e.model_config
    kv_token_bytes = e.runner.page_bytes() // e.page_size
    # correctness (teacher-forced logits and greedy) against HF fp32
    if ctx.get("hf"):
        hf = ctx["hf"]
        prompts = ctx["prompts"].tolist()
        ref_tokens = hf["greedy_fp32"]
        ours = forced_logits(e, prompts, ref_tokens.tolist())
        out["logit_err_vs_hf_fp32"] = rel_err(ours, hf["logits_fp32"])
        out["logit_maxabs_vs_hf_fp32"] = (ours - hf["logits_fp32"]).abs().max().item()
        del ours
        row(
            f"[{kv}] engine vs HF fp32 logits",
            f"{out['logit_err_vs_hf_fp32']:.2e}",
            f"rel L2 (HF bf16: {hf['bf16_logit_err']:.2e}); max abs {out['logit_maxabs_vs_hf_fp32']:.3f}",
        )
        greedy = torch.tensor(
            e.generate(prompts, SamplingParams(max_tokens=ref_tokens.shape[1], temperature=0.0, ignore_eos=True))
        )
        out["greedy_vs_hf_fp32"] = greedy_stats(greedy, ref_tokens)
        out["greedy_vs_hf_bf16"] = greedy_stats(greedy, hf["greedy_bf16"])
        out["hf_bf16_greedy_vs_hf_fp32"] = greedy_stats(hf["greedy_bf16"], ref_tokens)
        gs = out["greedy_vs_hf_fp32"]
        row(
            f"[{kv}] greedy exact match vs HF fp32",
            f"{gs['exact_match_rate']:.2%}",
            f"mean first divergence {gs['mean_tokens_before_divergence']:.1f}/64; HF bf16 vs fp32: "
            f"{out['hf_bf16_greedy_vs_hf_fp32']['exact_match_rate']:.2%}, "
            f"{out['hf_bf16_greedy_vs_hf_fp32']['mean_tokens_before_divergence']:.1f}/64",
        )
    # prefill 8k (chunk 2048)
    ids = torch.randint(5, SHAPE["vocab_size"], (8192,), generator=g).tolist()
    flops = prefill_flops(ctx["n_params"], 8192, mc.num_layers)
    ms = time_prefill(e, ids)
    out["prefill_ms"], out["prefill_tflops"] = ms, flops / (ms * 1e-3) / 1e12
    row(
        f"[{kv}] engine prefill 8k chunk 2048",
        f"{out['prefill_tflops']:.0f} TFLOP/s",
        f"{ms:.1f} ms wall; {out['prefill_tflops'] * 1e12 / ctx['matmul']:.0%} of matmul ceiling",
    )
    if not e.runner.kv_cache.quantized:
        paged = e.runner.cfg
        e.runner.set_kernels(dataclasses.replace(paged, dense_prefill_kernel="gather"))
        ms2 = time_prefill(e, ids)
        e.runner.set_kernels(paged)
        out["prefill_gather_tflops"] = flops / (ms2 * 1e-3) / 1e12
        row(
            f"[{kv}] engine prefill 8k, gather+varlen attention",
            f"{out['prefill_gather_tflops']:.0f} TFLOP/s",
            f"{ms2:.1f} ms",
        )
    weight_bytes = ctx["n_params"] * 2
    out["decode"] = decode_section(e, f"{kv}", ctx["copy_bw"], weight_bytes, kv_token_bytes, g)
    out["profile_b1"] = profile_decode(e, kv)
    if e.runner.kv_cache.quantized:  # the other int8 decode kernel, re-captured
        e.runner.set_kernels(dataclasses.replace(e.runner.cfg, int8_decode_kernel="dequant"))
        out["decode_dequant"] = decode_section(e, f"{kv}-dequant", ctx["copy_bw"], weight_bytes, kv_token_bytes, g)
    assert e.allocator.num_used == 0
    del e
    free_memory()
    return out


def capacity_gain() -> dict:
    """Sequences of 4096 tokens that fit a pool of the same bytes, dense bf16 vs int8 (sym, g64), by the engine's
    own page sizing; the budget is what the engine's auto sizing would take on this GPU now."""
    free, total = torch.cuda.mem_get_info(DEV)
    budget = free - 0.15 * total
    L, KVH, D, ps = 32, SHAPE["num_key_value_heads"], SHAPE["head_dim"], 16
    dense = int(budget // KVCache.bytes_per_page(L, ps, KVH, D, torch.bfloat16)) // (4096 // ps)
    int8 = int(budget // Int8KVCache.int8_bytes_per_page(L, ps, KVH, D, 64, False)) // (4096 // ps)
    row(
        "KV capacity at ctx 4k",
        f"bf16 {dense} seqs, int8 {int8} seqs",
        f"gain {int8 / dense:.3f}x (budget {budget / 2**30:.1f} GiB, 8B weights not loaded)",
    )
    return dict(budget_gib=budget / 2**30, dense_seqs=dense, int8_seqs=int8, gain=int8 / dense)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="default: /dev/shm/llama3-8b-random if it has room, else /tmp")
    ap.add_argument("--layers", type=int, default=32, help="fewer for a quick smoke run (figures then meaningless)")
    ap.add_argument("--json", default="docs/bench/gpu_engine.json")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    import shutil

    shm_ok = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 24e9
    model_dir = Path(args.model_dir or ("/dev/shm" if shm_ok else "/tmp") + "/llama3-8b-random")
    props = torch.cuda.get_device_properties(DEV)
    device = (
        f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB, torch "
        f"{torch.__version__}, CUDA {torch.version.cuda}"
    )
    log(f"device: {device}")
    copy_bw, matmul = ceilings()
    t0 = time.perf_counter()
    n_params = write_checkpoint(model_dir, args.layers)
    log(f"checkpoint: {n_params / 1e9:.3f}B params written to {model_dir} in {time.perf_counter() - t0:.1f}s")
    ctx = dict(n_params=n_params, copy_bw=copy_bw, matmul=matmul)
    g = torch.Generator(device=DEV).manual_seed(3)
    ctx["prompts"] = torch.randint(5, SHAPE["vocab_size"], (64, 64), device=DEV, generator=g)

    def section(name: str, fn):
        try:
            return fn()
        except Exception:
            import traceback

            traceback.print_exc()
            log(f"SECTION {name} FAILED")
            RESULTS.setdefault("failed", []).append(name)
            return {}

    if not args.skip_hf:
        ctx["hf"] = section("hf", lambda: hf_section(model_dir, n_params, args.layers, ctx["prompts"], 64))
    RESULTS["capacity"] = section("capacity", capacity_gain)
    RESULTS["kernels"] = section("kernels", lambda: kernel_section(copy_bw))
    if "decode_attn_best" in RESULTS["kernels"]:
        ctx["decode_choice"] = RESULTS["decode_choice"] = decode_choice(RESULTS["kernels"])
        log(f"decode kernel settings for the engines: {ctx['decode_choice']}")
    RESULTS["engine_bf16"] = section("engine_bf16", lambda: engine_section(model_dir, "auto", ctx))
    RESULTS["engine_int8"] = section("engine_int8", lambda: engine_section(model_dir, "int8", ctx))

    hf, eb, ei = ctx.get("hf", {}), RESULTS["engine_bf16"], RESULTS["engine_int8"]
    summary = {
        "prefill_8k_tflops": ei.get("prefill_tflops"),
        "hf_prefill_8k_tflops": hf.get("prefill_tflops"),
        "itl_ms_b1": eb.get("decode", {}).get("itl_ms"),
        "hf_itl_ms_b1": hf.get("itl_ms"),
        "decode_b128_roofline_ratio": eb.get("decode", {}).get("b128", {}).get("ratio"),
        "int8_kv_capacity_gain": RESULTS["capacity"].get("gain"),
        "quant_bw_fraction": RESULTS["kernels"].get("quant_bw_fraction"),
        "greedy_match_rate": eb.get("greedy_vs_hf_fp32", {}).get("exact_match_rate"),
        "logit_err_vs_hf_fp32": eb.get("logit_err_vs_hf_fp32"),
        "hf_bf16_logit_err_vs_fp32": hf.get("bf16_logit_err"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": device,
    }
    details = {
        "layers": args.layers,
        "n_params": n_params,
        "copy_bw": copy_bw,
        "matmul_flops": matmul,
        "hf": {k: v for k, v in hf.items() if not isinstance(v, torch.Tensor)},
        **RESULTS,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({**summary, "details": details}, indent=1, default=str))
    print_rows()
    print("\n" + json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
