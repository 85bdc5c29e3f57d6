"""The engine on one Hopper GPU: prefill FLOP rate, decode latency and throughput against the memory roofline,
correctness against HF transformers, int8 KV capacity and (de)quantization speed (issue 6's keys of
docs/bench/gpu_engine.json). Also the GPU helpers of bench/kv_formats.py.

    python bench/gpu_engine.py [--model-dir DIR] [--layers 32] [--skip-hf] [--json docs/bench/gpu_engine.json]

1. Ceilings measured here: device copy bandwidth (bytes read + written) and an 8192^3 bf16 matmul.
2. A Llama-3-8B-shaped checkpoint with random bf16 weights, written as a real HF checkpoint (sharded safetensors +
   index + tokenizer) and loaded by both HF transformers and the engine's loader.
3. HF transformers (bf16, SDPA): monolithic 8k prefill, `generate` ITL at batch 1; HF fp32 as the reference for
   greedy outputs (64 prompts x 64 tokens) and teacher-forced logits, HF bf16 against it as the yardstick.
4. int8 quantize / dequantize against the CPU path (bit-equal) and their bandwidth against a copy. Per-layer decode
   attention per KV format is bench/kv_formats.py.
5. The engine (FA3, fused kernels, decode CUDA graphs), bf16 KV then int8 KV: logits and greedy match vs HF fp32;
   8k-token chunked prefill; ITL at batch 1 / context 512; decode steps at batch 128 and 64 / context 2k against
   the roofline (all weight bytes + the batch's KV bytes, over the copy bandwidth); KV capacity at context 4k.

FP8 weights (issue 30) are bench/fp8_weights.py (docs/bench/fp8_weights.json).

FLOPs of a prefill: 2 * params * tokens + attention 2 * T^2 * head_dim * heads * layers (causal).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from benchutil import Table, log, merge_json, provenance, submit

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_cache import Int8KVCache, KVCache
from pdserve.engine.sampling import SamplingParams
from pdserve.models.random_llama import LLAMA3_8B_SHAPE, write_random_llama
from pdserve.testing.teacher_forcing import forced_logits

SHAPE = LLAMA3_8B_SHAPE
DEV = torch.device("cuda")


# ---- GPU helpers (bench/kv_formats.py uses them too) ----------------------------------------------------------
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


def graph_ms(fn, reps: int = 30) -> float:
    """Median ms per call of fn replayed from a CUDA graph (no launch overhead: what a decode graph pays)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay, reps=reps)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ceilings(table: Table) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s)."""
    x = torch.randn(1 << 30, device=DEV, dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    copy_bw = 2 * x.numel() * 2 / (cuda_ms(lambda: y.copy_(x)) * 1e-3)
    del x, y
    a, b = (torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    mm = 2 * 8192**3 / (cuda_ms(lambda: a @ b) * 1e-3)
    del a, b
    free_memory()
    table.row("copy bandwidth (read+write)", f"{copy_bw / 1e12:.2f} TB/s", "device-to-device copy of 2 GiB")
    table.row("bf16 matmul 8192^3", f"{mm / 1e12:.0f} TFLOP/s", "random data")
    return copy_bw, mm


def write_checkpoint(out: Path, layers: int, seed: int = 0) -> int:
    """Random bf16 Llama-3-8B-shaped checkpoint (HF layout). Returns the parameter count."""
    return write_random_llama(out, layers, seed, DEV, SHAPE)


def paged_decode_inputs(B: int, ctx: int, g: torch.Generator, ps: int = 16, kvh: int = 8, d: int = 128, hq: int = 32):
    """Random inputs of one layer's decode attention at batch B, context ctx: a bf16 pool kv [2, P, ps, KVH, D]
    (P = B * ctx / ps pages), its int8 quantization q8 / s8 (group 64), a shuffled page table [B, ctx / ps] int32,
    seqlens [B] int32 (all ctx) and queries qq [B, HQ, D] bf16."""
    from pdserve.kv import quant as Q

    P = B * ctx // ps
    kv = torch.randn(2, P, ps, kvh, d, device=DEV, generator=g).bfloat16()
    q8, s8, _ = Q.quantize(kv, 64, False)
    table = torch.randperm(P, device=DEV, generator=g).int().view(B, ctx // ps)
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
        kk, vv = (pool[j, slots].double().repeat_interleave(hq // pool.shape[2], 1) for j in (0, 1))
        a = torch.einsum("hd,nhd->hn", q[i].double(), kk) * d**-0.5
        out[i] = torch.einsum("hn,nhd->hd", a.softmax(-1), vv)
    return out


def make_engine(model_dir: Path, kv: str, num_pages: int, **kw) -> LLMEngine:
    """The 8B engine as served: bf16, page 16, chunk 2048, FA3, fused kernels and decode CUDA graphs."""
    t0 = time.perf_counter()
    cfg = EngineConfig(model_dir=str(model_dir), dtype="bfloat16", device="cuda", page_size=16, chunk_size=2048,
                       num_pages=num_pages, max_num_seqs=128, kv_dtype=kv, attention_backend="fa3", **kw)  # fmt: skip
    e = LLMEngine(cfg)
    assert e.runner.kernels.fused and e.runner.graph_runner is not None, "not the fused CUDA-graph path"
    log(f"engine kv={kv} {kw or ''}: load + graph capture {time.perf_counter() - t0:.1f}s")
    return e


def time_prefill(e: LLMEngine, ids: list[int] | Callable[[], list[int]], reps: int = 3) -> float:
    """Median wall ms from queueing a prompt to its first token over `reps` runs after a warm-up run; `ids`: the
    prompt, or a function making a fresh one for each run."""
    times = []
    for r in range(reps + 1):
        prompt = ids() if callable(ids) else ids
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        submit(e, f"pf{r}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while e.has_unfinished_requests():
            e.step()
        torch.cuda.synchronize()
        times += [(time.perf_counter() - t0) * 1e3] if r else []  # the first run warms up
    return statistics.median(times)


def fill_decode_batch(e: LLMEngine, batch: int, ctx: int, g: torch.Generator) -> None:
    """`batch` greedy requests ("d0".. ) of `ctx` random prompt tokens, stepped until every one is decoding."""
    sp = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        submit(e, f"d{i}", torch.randint(5, SHAPE["vocab_size"], (ctx,), generator=g).tolist(), sp)
    while len(e.scheduler.running) < batch or e.scheduler.waiting:
        e.step()


def time_decode_steps(e: LLMEngine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        e.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# ---- HF transformers ------------------------------------------------------------------------------------------
def prefill_flops(n_params: int, tokens: int, layers: int) -> float:
    return 2 * n_params * tokens + 2 * tokens**2 * SHAPE["head_dim"] * SHAPE["num_attention_heads"] * layers


def hf_section(table: Table, model_dir: Path, n_params: int, layers: int, prompts: torch.Tensor, n_gen: int) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, device_map="cuda").eval()
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 0
    g = torch.Generator(device=DEV).manual_seed(7)
    out: dict = {}
    gen = lambda ids, n: m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                    do_sample=False)[:, ids.shape[1]:]  # fmt: skip
    with torch.inference_mode():
        ids = torch.randint(5, SHAPE["vocab_size"], (1, 8192), device=DEV, generator=g)
        ms = out["prefill_ms"] = cuda_ms(lambda: m(ids, logits_to_keep=1), reps=3, warmup=1)
        out["prefill_tflops"] = prefill_flops(n_params, 8192, layers) / (ms * 1e-3) / 1e12
        table.row("HF prefill 8k (bf16, monolithic)", f"{out['prefill_tflops']:.0f} TFLOP/s", f"{ms:.1f} ms")
        p512 = torch.randint(5, SHAPE["vocab_size"], (1, 512), device=DEV, generator=g)
        gen(p512, 4)
        times = {}
        for n in (1, 33):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            gen(p512, n)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t0
        out["itl_ms"] = (times[33] - times[1]) / 32 * 1e3
        table.row("HF generate ITL b1 ctx512", f"{out['itl_ms']:.2f} ms", "(t(33 tokens) - t(1)) / 32")
        out["greedy_bf16"] = gen(prompts, n_gen).cpu()
        m.float()
        free_memory()
        out["greedy_fp32"] = gen(prompts, n_gen).cpu()
        full = torch.cat([prompts, out["greedy_fp32"].to(DEV)], 1)[:, :-1]
        logits = lambda: torch.cat(
            [m(full[i : i + 8], logits_to_keep=n_gen).logits.float() for i in range(0, len(full), 8)]
        )
        out["logits_fp32"] = logits()  # [N, n_gen, V] on the GPU
        m.to(torch.bfloat16)
        free_memory()
        bf = logits()
        out["bf16_logit_err"] = rel_err(bf, out["logits_fp32"])
    del m, bf
    free_memory()
    table.row("HF bf16 vs HF fp32 logits", f"{out['bf16_logit_err']:.2e}", "rel L2")
    return out


def greedy_stats(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Exact-match rate of whole continuations, first divergence per prompt (the length: none)."""
    first = [int(d[0]) if len(d := (o != r).nonzero()) else len(r) for o, r in zip(ours, ref)]
    return {"exact_match_rate": sum(f == ref.shape[1] for f in first) / len(first), "first_divergence": first,
            "mean_tokens_before_divergence": sum(first) / len(first)}  # fmt: skip


# ---- kernels --------------------------------------------------------------------------------------------------
def kernel_section(table: Table, copy_bw: float) -> dict:
    from pdserve.engine.kernels import kv_quant
    from pdserve.kv import quant as Q

    out: dict = {}
    g = torch.Generator(device=DEV).manual_seed(11)
    for asym in (False, True):  # the Triton (de)quantizer against the CPU torch path, bit for bit
        x = torch.randn(4096, 8, 128, device=DEV, generator=g).bfloat16() * 3
        q, s, z = kv_quant.quantize(x, 64, asym)
        qc, sc, zc = Q.quantize(x.cpu(), 64, asym)
        same = torch.equal(q.cpu(), qc) and torch.equal(s.cpu(), sc) and (z is None or torch.equal(z.cpu(), zc))
        same = same and torch.equal(kv_quant.dequantize(q, s, z, 64, torch.bfloat16).cpu(),
                                    Q.dequantize(qc, sc, zc, 64, torch.bfloat16))  # fmt: skip
        out[f"quant_bitwise_{'asym' if asym else 'sym'}"] = same
        table.row(f"int8 {'asym' if asym else 'sym'} g64 == CPU path", str(same))
    x = torch.randn(1 << 21, 128, device=DEV, generator=g).bfloat16() * 4  # 512 MiB bf16
    n = x.numel()
    q, s, _ = kv_quant.quantize(x, 64, False)
    bq = (2 * n + n + 2 * n // 64) / (cuda_ms(lambda: kv_quant.quantize(x, 64, False)) * 1e-3)
    bd = (n + 2 * n // 64 + 2 * n) / (cuda_ms(lambda: kv_quant.dequantize(q, s, None, 64, torch.bfloat16)) * 1e-3)
    out.update(quant_bw=bq, dequant_bw=bd, quant_bw_fraction=min(bq, bd) / copy_bw)
    table.row("int8 quantize / dequantize g64", f"{bq / 1e12:.2f} / {bd / 1e12:.2f} TB/s",
              f"{bq / copy_bw:.0%} / {bd / copy_bw:.0%} of copy")  # fmt: skip
    del x, q, s
    free_memory()
    return out


# ---- engine ---------------------------------------------------------------------------------------------------
def decode_section(table: Table, e: LLMEngine, kv: str, copy_bw: float, weight_bytes: int, g) -> dict:
    """ITL at batch 1 / ctx 512, then batch 128 and 64 at ctx 2k; graph replay time beside each engine step."""
    out: dict = {}
    kv_token_bytes = e.runner.page_bytes() // e.page_size
    graphs = e.runner.graph_runner.graphs
    sp = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    submit(e, "itl", torch.randint(5, SHAPE["vocab_size"], (512,), generator=g).tolist(), sp)
    e.step()  # prefill
    steps = time_decode_steps(e, 160)[10:]
    dec = statistics.quantiles(steps, n=10)
    roof = (weight_bytes + 597 * kv_token_bytes) / copy_bw * 1e3  # mean context of the 150 timed steps
    out.update(itl_ms=statistics.median(steps), itl_ms_p10_p90=(dec[0], dec[-1]), itl_roofline_ms=roof,
               graph_b1_ms=cuda_ms(graphs[1].replay))  # fmt: skip
    table.row(f"[{kv}] ITL b1 ctx512", f"{out['itl_ms']:.2f} ms", f"p10 {dec[0]:.2f}, p90 {dec[-1]:.2f}; graph "
              f"{out['graph_b1_ms']:.2f} ms; roofline {roof:.2f} ms, ratio {out['itl_ms'] / roof:.2f}")  # fmt: skip
    e.abort("itl")
    e.step()
    fill_decode_batch(e, 128, 2048, g)
    for B in (128, 64):
        if B == 64:
            for i in range(64, 128):
                e.abort(f"d{i}")
            e.step()
        ctx = sum(s.num_tokens for s in e.scheduler.running) / B + 15  # mean context over the timed steps
        t = statistics.median(time_decode_steps(e, 25)[5:])
        roof = (weight_bytes + B * ctx * kv_token_bytes) / copy_bw * 1e3
        gpu = cuda_ms(graphs[B].replay, reps=10)
        out[f"b{B}"] = dict(step_ms=t, graph_ms=gpu, roofline_ms=roof, ratio=t / roof, tokens_per_s=B / t * 1e3)
        table.row(f"[{kv}] decode b{B} ctx2k step", f"{t:.2f} ms ({B / t * 1e3:.0f} tok/s)",
                  f"roofline {roof:.2f} ms: ratio {t / roof:.2f} (graph alone {gpu:.2f} ms)")  # fmt: skip
    for i in range(64):
        e.abort(f"d{i}")
    e.step()
    return out


def engine_section(table: Table, model_dir: Path, kv: str, ctx: dict) -> dict:
    g = torch.Generator().manual_seed(5 if kv == "auto" else 6)
    out: dict = {}
    e = make_engine(model_dir, kv, num_pages=18400)
    if ctx.get("hf"):  # correctness against HF fp32: teacher-forced logits, then greedy continuations
        hf, prompts = ctx["hf"], ctx["prompts"].tolist()
        ours = torch.stack(forced_logits(e, prompts, hf["greedy_fp32"].tolist()))
        out["logit_err_vs_hf_fp32"] = rel_err(ours, hf["logits_fp32"])
        del ours
        sp = SamplingParams(max_tokens=hf["greedy_fp32"].shape[1], temperature=0.0, ignore_eos=True)
        greedy = torch.tensor(e.generate(prompts, sp))
        out["greedy_vs_hf_fp32"] = gs = greedy_stats(greedy, hf["greedy_fp32"])
        out["hf_bf16_greedy_vs_hf_fp32"] = hs = greedy_stats(hf["greedy_bf16"], hf["greedy_fp32"])
        table.row(f"[{kv}] engine vs HF fp32", f"logits {out['logit_err_vs_hf_fp32']:.2e} rel L2, greedy "
                  f"{gs['exact_match_rate']:.2%}", f"HF bf16: {hf['bf16_logit_err']:.2e}, "
                  f"{hs['exact_match_rate']:.2%}")  # fmt: skip
    ids = torch.randint(5, SHAPE["vocab_size"], (8192,), generator=g).tolist()
    ms = time_prefill(e, ids)
    out["prefill_ms"] = ms
    out["prefill_tflops"] = prefill_flops(ctx["n_params"], 8192, e.model_config.num_layers) / ms / 1e9
    table.row(f"[{kv}] engine prefill 8k chunk 2048", f"{out['prefill_tflops']:.0f} TFLOP/s",
              f"{ms:.1f} ms; {out['prefill_tflops'] * 1e12 / ctx['matmul']:.0%} of the matmul ceiling")  # fmt: skip
    out["decode"] = decode_section(table, e, kv, ctx["copy_bw"], ctx["n_params"] * 2, g)
    del e
    free_memory()
    return out


def capacity_gain(table: Table) -> dict:
    """Sequences of 4096 tokens that fit a pool of the same bytes, dense bf16 vs int8 (sym, g64), by the engine's
    own page sizing; the budget is what the engine's auto sizing would take on this GPU now."""
    free, total = torch.cuda.mem_get_info(DEV)
    budget = free - 0.15 * total
    L, KVH, D, ps = 32, SHAPE["num_key_value_heads"], SHAPE["head_dim"], 16
    dense = int(budget // KVCache.bytes_per_page(L, ps, KVH, D, torch.bfloat16)) // (4096 // ps)
    int8 = int(budget // Int8KVCache.int8_bytes_per_page(L, ps, KVH, D, 64, False)) // (4096 // ps)
    table.row("KV capacity at ctx 4k", f"bf16 {dense} seqs, int8 {int8} seqs", f"gain {int8 / dense:.3f}x")
    return dict(budget_gib=budget / 2**30, dense_seqs=dense, int8_seqs=int8, gain=int8 / dense)


def section(results: dict, name: str, fn: Callable[[], dict]) -> dict:
    """fn(), or {} with `name` added to results["failed"] when it raises (the other sections still run)."""
    try:
        return fn()
    except Exception:
        traceback.print_exc()
        results.setdefault("failed", []).append(name)
        return {}
    finally:
        free_memory()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="default: /dev/shm/llama3-8b-random if it has room, else /tmp")
    ap.add_argument("--layers", type=int, default=32, help="fewer for a quick smoke run (figures then meaningless)")
    ap.add_argument("--json", default="docs/bench/gpu_engine.json")
    ap.add_argument("--commit", default="", help="the commit measured (a copied tree may lack git)")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    shm_ok = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 24e9
    model_dir = Path(args.model_dir or ("/dev/shm" if shm_ok else "/tmp") + "/llama3-8b-random")
    table, results = Table(), {}
    copy_bw, matmul = ceilings(table)
    n_params = write_checkpoint(model_dir, args.layers)
    ctx = dict(n_params=n_params, copy_bw=copy_bw, matmul=matmul)
    ctx["prompts"] = torch.randint(5, SHAPE["vocab_size"], (64, 64), device=DEV,
                                   generator=torch.Generator(device=DEV).manual_seed(3))  # fmt: skip

    run_hf = lambda: hf_section(table, model_dir, n_params, args.layers, ctx["prompts"], 64)
    hf = ctx["hf"] = {} if args.skip_hf else section(results, "hf", run_hf)
    results["capacity"] = section(results, "capacity", lambda: capacity_gain(table))
    results["kernels"] = section(results, "kernels", lambda: kernel_section(table, copy_bw))
    eb = results["engine_bf16"] = section(results, "engine_bf16", lambda: engine_section(table, model_dir, "auto", ctx))
    ei = results["engine_int8"] = section(results, "engine_int8", lambda: engine_section(table, model_dir, "int8", ctx))
    keys = {
        "prefill_8k_tflops": ei.get("prefill_tflops"),
        "hf_prefill_8k_tflops": hf.get("prefill_tflops"),
        "itl_ms_b1": eb.get("decode", {}).get("itl_ms"),
        "hf_itl_ms_b1": hf.get("itl_ms"),
        "decode_b128_roofline_ratio": eb.get("decode", {}).get("b128", {}).get("ratio"),
        "int8_kv_capacity_gain": results["capacity"].get("gain"),
        "quant_bw_fraction": results["kernels"].get("quant_bw_fraction"),
        "greedy_match_rate": eb.get("greedy_vs_hf_fp32", {}).get("exact_match_rate"),
        "logit_err_vs_hf_fp32": eb.get("logit_err_vs_hf_fp32"),
        "hf_bf16_logit_err_vs_fp32": hf.get("bf16_logit_err"),
    }
    hf_plain = {k: v for k, v in hf.items() if not isinstance(v, torch.Tensor)}
    details = {"layers": args.layers, "n_params": n_params, "copy_bw": copy_bw, "matmul_flops": matmul, "hf": hf_plain}
    merge_json(args.json, {**keys, **provenance(args.commit,
               torch.cuda.get_device_name(DEV)), "details": {**details, **results}})  # fmt: skip
    table.print()


if __name__ == "__main__":
    sys.exit(main())
