"""FP8 weights (issue 30): every GPU key of docs/bench/fp8_weights.json from one run on one H200, and the perplexity
keys from a separate CPU run.

    python bench/fp8_weights.py [--commit SHA] [--json docs/bench/fp8_weights.json]       # GPU, one run, < 6 min
    python bench/fp8_weights.py --ppl [--json ...]                                         # CPU: merges ppl_*

GPU run, in order (progress logged; the JSON is written at the end, ppl_* / quality kept from the CPU run):
1. copy bandwidth (read + write of 2 GiB; the rooflines' denominator);
2. one 8B layer's GEMMs per format and token count (bf16, FP8 per channel via `_scaled_mm`, FP8 block via cuBLAS's
   block-scaled `_scaled_mm` and via the Triton GEMM, the split-K Triton GEMM of decode batches at M <= 256 (what
   the engine runs there; bench/fp8_gemm_sweep.py times its configs), the FP8 GEMV at M <= 16), CUDA-graph
   timed, with the GEMV's `SWEEP_CONFIGS` at M = 1 and the Triton block GEMM's at M = 128 and 2048 (details only;
   `--skip-gemm`: none);
3. the Llama-3-8B shape, all 32 layers, random weights made on the device (`--load-format dummy`: no checkpoint is
   written; lm_head bf16 as in FP8 checkpoints), int8 KV, decode CUDA graphs: bf16, FP8 per channel (config.json
   quantization_config compressed-tensors channel) and FP8 block (quant_method fp8, 128x128): 8k prefill TFLOP/s,
   ITL b1 ctx 512 and its roofline (every weight byte a step reads + the KV bytes, over the copy bandwidth), decode
   step b128 ctx 2k. `*_fp8` keys: the better FP8 format per figure;
4. a Llama-3-70B-shaped FP8 model (hidden 8192, 80 layers, 64 q / 8 KV heads, FFN 28672, vocab 128256; per-channel
   compressed-tensors config) served by `pdserve up --colocated 1 --load-format dummy` with int8 KV on GPU 0:
   random FP8 weights generated on the device (no 70 GB checkpoint); served TTFT of fresh 2k prompts (median of 5
   after a warm-up), ITL at batch 1 (fresh 512-token prompts, 64 tokens, (t_last - t_first) / 63, median of 3), the
   KV pool capacity in tokens from the instance's Stats (kv_pages_total x page_size); then, once the stack has
   exited, the same config in this process (`details.70b.engine`: TTFT 2k and ITL b1 of the engine alone, the
   served figures' in-process counterparts).

`--ppl` (CPU): SmolLM2-135M-Instruct (the demo model) on the quality set of bench/kv_formats.py (the shipped corpus,
`--windows` (default 8) windows of 64 prompt + 256 scored tokens, spread evenly over it) through the CPU path:
bf16 (weights and math), FP8 block and FP8 per-channel copies (fp8_convert) dequantized at load, fp32 math; rows
`fp8_channel_w8a8` / `fp8_block_w8a8` (in `quality.ppl_w8a8`, not keys of the issue's) run the same copies through
the GPU path's math, activations quantized per token (per 128 columns for block weights) as its prefill GEMMs and
decode batches above 16 rows do (`pdserve.testing.fp8_reference`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchutil import Table, log, merge_json, provenance, submit, token_times_ms

PPL_KEYS = ("ppl_bf16", "ppl_fp8_block", "ppl_fp8_channel", "quality")  # written by --ppl, kept by the GPU run
SHAPE_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128)  # fmt: skip
FORMATS_8B = {"bf16": None, "fp8_channel": "channel", "fp8_block": "block"}  # name -> fp8_convert format


# ---- model directories without weights (--load-format dummy) ---------------------------------------------------
def write_config_dir(out: Path, shape: dict, layers: int, fp8: str | None, max_pos: int = 16384) -> Path:
    """A Llama model directory holding config.json (+ `fp8`'s quantization_config) and a tiny tokenizer, no
    weights: the engine builds it with `load_format="dummy"`."""
    from pdserve.engine.quant.fp8_convert import quantization_config
    from pdserve.models.checkpoints import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=layers,
               max_position_embeddings=max_pos, rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=1,
               eos_token_id=2, tie_word_embeddings=False, hidden_act="silu", torch_dtype="bfloat16",
               **shape)  # fmt: skip
    if fp8:
        cfg["quantization_config"] = quantization_config(fp8)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if not (out / "tokenizer.json").exists():
        build_tokenizer(out)
    return out


def params(shape: dict, layers: int) -> int:
    """Parameters of a Llama of `shape` (embeddings and lm_head included; norms ignored)."""
    h, i, hd, v = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"], shape["vocab_size"]
    qd, kvd = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    return layers * (h * (qd + 2 * kvd) + qd * h + 3 * h * i) + 2 * v * h


def prefill_flops(shape: dict, layers: int, tokens: int) -> float:
    """Matmul FLOPs of a causal prefill: 2 x params x tokens + attention 2 x T^2 x head_dim x heads x layers."""
    attn = 2 * tokens**2 * shape["head_dim"] * shape["num_attention_heads"] * layers
    return 2 * params(shape, layers) * tokens + attn


# ---- one 8B layer's GEMMs (GPU, details) -----------------------------------------------------------------------
PROJ = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # 8B (N, K)
# rows of the GEMM table: (name, weights, GEMV rows (0: never the GEMV), block backend)
# (row name, weights, GEMV rows, block backend, split-K GEMM rows): channel / block are cuBLAS's `_scaled_mm` (the
# Triton prefill tiles where cuBLAS's block scales do not take M), block_triton the Triton prefill tiles, skinny the
# split-K Triton GEMM of decode batches (M <= 256), gemv the weight-only GEMV (M <= 16)
VARIANTS = [("channel", "channel", 0, "auto", 0), ("block", "block", 0, "auto", 0),
            ("block_triton", "block", 0, "triton", 0), ("skinny_channel", "channel", 0, "auto", 256),
            ("skinny_block", "block", 0, "auto", 256), ("gemv_channel", "channel", 16, "auto", 0),
            ("gemv_block", "block", 16, "auto", 0)]  # fmt: skip


def gemm_rows(ge, table: Table, copy_bw: float) -> dict:
    """CUDA-graph ms of one 8B layer's four projections per token count: bf16, FP8 per channel (_scaled_mm) and
    block (Triton GEMM), activation quantization included, the split-K GEMM (M <= 256) and the weight-only GEMV
    (M <= 16) (VARIANTS); at M = 1 the GEMV's
    tiles (block scales) and its default, as weight TB/s."""
    from pdserve.engine.quant import fp8_block_gemm as block_gemm
    from pdserve.engine.quant import fp8_quant as Q
    from pdserve.engine.quant.fp8_checkpoint import ONLINE_FP8, Fp8Scheme
    from pdserve.engine.quant.fp8_gemv import SWEEP_CONFIGS, counter_slots, fp8_gemv
    from pdserve.engine.quant.fp8_linear import Fp8Linear

    dev = ge.DEV
    w = {p: torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for p, (n, k) in PROJ.items()}
    lin, rows, sweep, tiles = {}, [], [], []
    block = Fp8Scheme(weights="block", block_size=(128, 128), source="fp8")
    for kind, scheme, quant in (("channel", ONLINE_FP8, Q.quantize_weight_per_channel),
                                ("block", block, Q.quantize_weight_blocks)):  # fmt: skip
        for p, (n, k) in PROJ.items():
            lin[kind, p] = Fp8Linear(k, n, False, scheme).to(dev)
            lin[kind, p].weight[:], lin[kind, p].weight_scale[:] = quant(w[p])
    for m in (1, 16, 128, 2048, 8192):
        x = {p: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for p, (_, k) in PROJ.items()}
        row = {"tokens": m, "bf16_ms": ge.graph_ms(lambda: [torch.nn.functional.linear(x[p], w[p]) for p in PROJ])}
        for name, kind, gemv_rows, backend, skinny_rows in VARIANTS:
            if (gemv_rows == 0 or m <= gemv_rows) and m <= (skinny_rows or m):  # each where it applies
                for p in PROJ:
                    lin[kind, p].gemv_max_rows, lin[kind, p].block_backend = gemv_rows, backend
                    lin[kind, p].skinny_max_rows = skinny_rows
                row[f"fp8_{name}_ms"] = ge.graph_ms(lambda kind=kind: [lin[kind, p](x[p]) for p in PROJ])
        if m in (128, 2048):  # the Triton block GEMM's tiles (activations quantized once, outside the timing)
            xq = {p: Q.quantize_activations(x[p], 128) for p in PROJ}
            for cfg in [block_gemm.default_config(m, 4096), *block_gemm.SWEEP_CONFIGS]:  # first: the default's
                try:  # a tile that does not compile or fit is logged; the others still count
                    ms = ge.graph_ms(lambda c=cfg: [block_gemm.block_gemm(*xq[p], lin["block", p].weight,
                                                    lin["block", p].weight_scale, config=c) for p in PROJ])  # fmt: skip
                    flops = 2 * m * sum(n * k for n, k in PROJ.values())
                    tiles.append({"tokens": m, **cfg, "ms": ms, "tflops": flops / ms / 1e9})
                except Exception as exc:
                    log(f"block GEMM tile {cfg}: {type(exc).__name__}: {exc}")
            best = min((t for t in tiles if t["tokens"] == m), key=lambda t: t["ms"], default=None)
            table.row(f"block GEMM M={m} best tile", f"{best['tflops']:.0f} TFLOP/s" if best else "-", str(best))
        flops = sum(2 * m * n * k for n, k in PROJ.values())
        row.update({k.replace("_ms", "_tflops"): flops / v / 1e9 for k, v in list(row.items()) if k.endswith("_ms")})
        rows.append(row)
        table.row(f"8B layer GEMMs M={m}", " ".join(f"{k[:-3]} {v:.3f}" for k, v in row.items() if k[-3:] == "_ms"))
    x1 = {p: torch.randn(1, k, device=dev, dtype=torch.bfloat16) for p, (_, k) in PROJ.items()}
    b = {p: lin["block", p] for p in PROJ}
    tickets = {p: torch.zeros(counter_slots(n), dtype=torch.int32, device=dev) for p, (n, _) in PROJ.items()}
    for cfg in [{}, *SWEEP_CONFIGS]:  # {}: the default (per-shape) choice
        try:  # a tile that does not compile or fit is logged; the others still count
            ms = ge.graph_ms(lambda c=cfg: [fp8_gemv(x1[p], b[p].weight, b[p].weight_scale, None, 128,
                                                     counters=tickets[p], **c) for p in PROJ])  # fmt: skip
            sweep.append({**(cfg or {"default": True}), "ms": ms,
                          "weight_tb_s": sum(n * k for n, k in PROJ.values()) / ms / 1e9})  # fmt: skip
        except Exception as exc:
            log(f"GEMV tile {cfg}: {type(exc).__name__}: {exc}")
    best = min(sweep, key=lambda r: r["ms"])
    table.row("FP8 GEMV M=1 default / best tile", f"{sweep[0]['weight_tb_s']:.2f} / {best['weight_tb_s']:.2f} TB/s",
              f"{best}; copy {copy_bw / 2e12:.2f} TB/s")  # fmt: skip
    return dict(gemm_8b_layer=rows, gemv_sweep_m1_block=sweep, block_gemm_tiles=tiles)


# ---- 8B shape in-process (GPU) ---------------------------------------------------------------------------------
def engine_8b(ge, table: Table, model_dir: Path, name: str, copy_bw: float, steps: int) -> dict:
    """One engine of the 8B shape (int8 KV, graphs): 8k prefill FLOP rate, ITL b1 ctx 512 and its roofline, decode
    step b128 ctx 2k. Frees the engine before returning."""
    from pdserve.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(8)
    vocab = ge.SHAPE["vocab_size"]
    e = ge.make_engine(model_dir, "int8", num_pages=18400, load_format="dummy")
    # the median of 5 (of 2 it is their mean: one slow run moves it)
    ms = ge.time_prefill(e, torch.randint(5, vocab, (8192,), generator=g).tolist(), reps=5)
    out = {"prefill_8k_ms": ms, "prefill_8k_tflops": prefill_flops(ge.SHAPE, 32, 8192) / ms / 1e9}
    sp = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
    submit(e, "itl", torch.randint(5, vocab, (512,), generator=g).tolist(), sp)
    e.step()  # prefill
    out["itl_ms_b1"] = statistics.median(ge.time_decode_steps(e, 10 + steps)[10:])
    kv_bytes = (512 + 10 + steps // 2) * e.runner.page_bytes() // e.page_size  # mean context of the timed steps
    tensors = [*e.runner.model.named_parameters(), *e.runner.model.named_buffers()]  # read each step, but embeddings
    out["weight_bytes_read"] = sum(t.numel() * t.element_size() for n, t in tensors if "embed_tokens" not in n)
    out["itl_roofline_ms_b1"] = (out["weight_bytes_read"] + kv_bytes) / copy_bw * 1e3
    e.abort("itl")
    e.step()
    ge.fill_decode_batch(e, 128, 2048, g)
    out["step_ms_b128"] = statistics.median(ge.time_decode_steps(e, 5 + steps)[5:])
    table.row(f"[8B {name}] prefill 8k / ITL b1 / step b128", f"{out['prefill_8k_tflops']:.0f} TFLOP/s, "
              f"{out['itl_ms_b1']:.3f} ms (roofline {out['itl_roofline_ms_b1']:.3f}), {out['step_ms_b128']:.2f} ms",
              "32 layers, dummy weights")  # fmt: skip
    del e
    ge.free_memory()  # the engine and its handoff refer to each other: gc before the next engine's pool
    return out


# ---- 70B shape served (GPU) ------------------------------------------------------------------------------------
def served_70b(table: Table, workdir: Path, copy_bw: float, reps: int = 5, shape: dict = SHAPE_70B, layers: int = 80,
               gpus: list[int] | None = None, prompt: int = 2048, flags: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """`pdserve up --colocated 1 --load-format dummy` of the 70B-shaped FP8 config on GPU 0 (`gpus`; the other
    arguments: a small smoke run on CPU), int8 KV: served TTFT 2k, ITL b1, KV capacity. `flags`: more instance
    flags. The stack is stopped before returning."""
    import pdserve
    from pdserve.cli.launch import start_stack
    from pdserve.server.grpc_util import channel
    from pdserve.server.security import ChannelSecurity
    from pdserve.v1 import internal_pb2, internal_pb2_grpc

    model = write_config_dir(workdir / "llama3-70b-fp8-config", shape, layers, "channel")
    t0 = time.perf_counter()
    log("70B: starting pdserve up --colocated 1 --load-format dummy (random FP8 weights made on the GPU)")
    extra = ["--load-format", "dummy", "--max-num-seqs", "8", "--chunk-size", "2048", *flags]
    stack = start_stack(model, workdir / "stack", kv_dtype="int8", gpus=[0] if gpus is None else gpus,
                        num_colocated=1, extra=extra, timeout=300)  # fmt: skip
    out: dict = {"start_to_ready_s": time.perf_counter() - t0}
    log(f"70B: ready after {out['start_to_ready_s']:.0f} s")
    rng = torch.Generator().manual_seed(70)
    fresh = lambda n: torch.randint(5, shape["vocab_size"], (n,), generator=rng).tolist()
    try:
        with channel(stack.colocated[0], ChannelSecurity(token=stack.internal_token)) as ch:
            s = internal_pb2_grpc.DecodeStub(ch).Stats(internal_pb2.StatsRequest(), timeout=10)
        out.update(kv_pages_total=s.kv_pages_total, page_size=s.page_size, kv_dtype=s.kv_dtype)
        out["kv_tokens"] = s.kv_pages_total * s.page_size
        with pdserve.Client(stack.router, timeout=120) as c:
            token_times_ms(c, fresh(prompt))  # warm-up
            ttft = [token_times_ms(c, fresh(prompt))[0][0] for _ in range(reps)]
            out.update(ttft_ms_2k=statistics.median(ttft), ttft_ms_2k_all=ttft)
            itl = []
            for _ in range(3):
                times, _ = token_times_ms(c, fresh(512), max_tokens=64)
                itl.append((times[-1] - times[0]) / (len(times) - 1))
            out.update(itl_ms_b1=statistics.median(itl), itl_ms_b1_all=itl)
        budget = [ln for lg in sorted((workdir / "stack").rglob("colocated*.log"))
                  for ln in lg.read_text(errors="replace").splitlines() if "colocated step budget" in ln]  # fmt: skip
        out["step_budget"] = budget[-1].split("colocated step budget: ", 1)[-1] if budget else None
    finally:
        stack.stop()
    n, emb = params(shape, layers), shape["vocab_size"] * shape["hidden_size"]
    layer_bytes = n - 2 * emb  # e4m3: one byte per projection weight (scales: 4 bytes per row, negligible)
    kvh, hd = shape["num_key_value_heads"], shape["head_dim"]
    kv_token = layers * 2 * kvh * (hd + 2 * hd // 64)  # int8 g64: K and V, 1 byte a value + an fp16 scale per 64
    out["weight_bytes_read"] = layer_bytes + 2 * emb  # + the bf16 lm_head
    out["itl_roofline_ms_b1"] = (out["weight_bytes_read"] + (512 + 32) * kv_token) / copy_bw * 1e3
    table.row("[70B fp8 served] TTFT 2k / ITL b1 / KV", f"{out['ttft_ms_2k']:.0f} ms, {out['itl_ms_b1']:.2f} ms "
              f"(roofline {out['itl_roofline_ms_b1']:.2f}), {out['kv_tokens']} tokens",
              f"ready in {out['start_to_ready_s']:.0f} s")  # fmt: skip
    return out


def engine_70b(ge, table: Table, workdir: Path, served: dict, steps: int, reps: int = 5) -> dict:
    """The served 70B figures' in-process counterpart from the same config (after the stack has exited): one engine
    in this process as the colocated instance runs it (dummy FP8 weights, int8 KV, chunk 2048, graphs), a pool
    of 2048 pages: TTFT of a fresh 2048-token prompt (median of `reps`) and ITL b1 at context 512."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    cfg = EngineConfig(model_dir=str(workdir / "llama3-70b-fp8-config"), dtype="bfloat16", device="cuda",
                       page_size=16, chunk_size=2048, num_pages=2048, max_num_seqs=8, kv_dtype="int8",
                       attention_backend="fa3", load_format="dummy")  # fmt: skip
    e = LLMEngine(cfg)
    out: dict = {"load_s": time.perf_counter() - t0}
    rng = torch.Generator().manual_seed(71)
    fresh = lambda n: torch.randint(5, SHAPE_70B["vocab_size"], (n,), generator=rng).tolist()
    out["ttft_ms_2k"] = ge.time_prefill(e, lambda: fresh(2048), reps=reps)
    submit(e, "itl70", fresh(512), SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
    e.step()  # prefill
    out["itl_ms_b1"] = statistics.median(ge.time_decode_steps(e, 10 + steps)[10:])
    e.abort("itl70")
    e.step()
    roof = served.get("itl_roofline_ms_b1")
    table.row("[70B fp8 in-process] TTFT 2k / ITL b1", f"{out['ttft_ms_2k']:.0f} ms, {out['itl_ms_b1']:.2f} ms",
              f"served {served.get('ttft_ms_2k', float('nan')):.0f} ms / {served.get('itl_ms_b1', float('nan')):.2f} "
              f"ms; roofline {roof or float('nan'):.2f} ms")  # fmt: skip
    del e
    ge.free_memory()
    return out


# ---- the GPU run -----------------------------------------------------------------------------------------------
def gpu_main(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_engine as ge

    t_start = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    table, details = Table(), {}
    x = torch.randn(1 << 30, device=ge.DEV, dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    copy_bw = 2 * x.numel() * 2 / (ge.cuda_ms(lambda: y.copy_(x)) * 1e-3)
    del x, y
    ge.free_memory()
    table.row("copy bandwidth (read+write)", f"{copy_bw / 1e12:.2f} TB/s")
    if not args.skip_gemm:
        details["gemm"] = ge.section(details, "gemm", lambda: gemm_rows(ge, table, copy_bw))
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.formats.split(","):
            fmt = FORMATS_8B[name]
            log(f"8B {name}: {time.perf_counter() - t_start:.0f} s into the run")
            d = write_config_dir(Path(tmp) / name, ge.SHAPE, 32, fmt)
            rows[name] = ge.section(details, f"8b_{name}", lambda d=d, n=name: engine_8b(ge, table, d, n, copy_bw,
                                                                                      args.steps))  # fmt: skip
        details["8b"] = rows
        log(f"70B: {time.perf_counter() - t_start:.0f} s into the run")
        big = ge.section(details, "70b", lambda: served_70b(table, Path(tmp), copy_bw))
        details["70b"] = big
        if big:
            log(f"70B in-process: {time.perf_counter() - t_start:.0f} s into the run")
            big["engine"] = ge.section(details, "70b_engine", lambda: engine_70b(ge, table, Path(tmp), big, args.steps))
    keys: dict = {}
    bf = rows.get("bf16") or {}
    fp8 = [r for n, r in rows.items() if n != "bf16" and r]
    if bf:
        keys.update(prefill_8k_tflops_bf16=bf["prefill_8k_tflops"], itl_ms_b1_bf16=bf["itl_ms_b1"],
                    step_ms_b128_bf16=bf["step_ms_b128"])  # fmt: skip
    if fp8:  # the better FP8 format per figure; the roofline is that of the faster ITL's format
        best = min(fp8, key=lambda r: r["itl_ms_b1"])
        keys.update(prefill_8k_tflops_fp8=max(r["prefill_8k_tflops"] for r in fp8), itl_ms_b1_fp8=best["itl_ms_b1"],
                    itl_roofline_ms_b1_fp8=best["itl_roofline_ms_b1"],
                    step_ms_b128_fp8=min(r["step_ms_b128"] for r in fp8))  # fmt: skip
    if big:
        keys.update(served_ttft_ms_2k_70b_fp8=big["ttft_ms_2k"], itl_ms_b1_70b_fp8=big["itl_ms_b1"],
                    kv_tokens_70b_int8=big["kv_tokens"])  # fmt: skip
    path = Path(args.json)
    old = json.loads(path.read_text()) if path.exists() else {}
    doc = {**provenance(args.commit, torch.cuda.get_device_name(ge.DEV)), **keys,
           **{k: old[k] for k in PPL_KEYS if k in old}}  # fmt: skip
    doc["details"] = {"copy_bw": copy_bw, "run_s": time.perf_counter() - t_start, **details,
                      "weights": "random, made on the device (--load-format dummy): no checkpoint written"}  # fmt: skip
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    log(f"wrote {path} after {time.perf_counter() - t_start:.0f} s")
    table.print()


# ---- perplexity (CPU) ------------------------------------------------------------------------------------------
def ppl_main(args, seqs: int = 8, prompt: int = 64, forced: int = 256) -> None:
    """ppl_bf16 / ppl_fp8_block / ppl_fp8_channel of the demo model on the quality set, CPU, into --json."""
    from transformers import AutoTokenizer

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.quant.fp8_convert import convert_checkpoint
    from pdserve.models.demo import ensure_smol
    from pdserve.models.train_tiny import split_corpus
    from pdserve.testing.fp8_reference import use_fp8_reference
    from pdserve.testing.teacher_forcing import forced_logits

    torch.set_num_threads(args.threads)
    path = ensure_smol()
    ids = AutoTokenizer.from_pretrained(str(path))("\n".join(split_corpus()))["input_ids"]
    wins = [ids[i * (len(ids) // seqs) :][: prompt + forced] for i in range(seqs)]
    target = torch.tensor([t for w in wins for t in w[prompt:]])
    kw = dict(device="cpu", attention_backend="sdpa", page_size=16, chunk_size=512, max_num_seqs=seqs,
              num_pages=seqs * (-(-(prompt + forced) // 16) + 1), kv_dtype="auto")  # fmt: skip
    out: dict = {}
    q: dict = {"model": path.name, "scored_tokens": target.numel(), "windows": seqs, "prompt": prompt, "seconds": {}}
    converted: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.formats.split(","):
            t0 = time.perf_counter()
            fmt = name.removeprefix("fp8_").removesuffix("_w8a8")
            if name.startswith("fp8") and fmt not in converted:  # one copy per format (the w8a8 row reuses it)
                converted[fmt] = convert_checkpoint(path, Path(tmp) / fmt, fmt)
            model_dir = converted.get(fmt, path)
            cfg = EngineConfig(model_dir=str(model_dir), dtype="bfloat16" if name == "bf16" else "float32", **kw)
            engine = LLMEngine(cfg)
            if name.endswith("_w8a8"):  # the GPU's math: activations quantized too (not a key of the issue's)
                assert use_fp8_reference(engine), name
            lg = torch.cat(forced_logits(engine, [w[:prompt] for w in wins], [w[prompt:] for w in wins]))
            ppl = round(math.exp(torch.nn.functional.cross_entropy(lg.float(), target).item()), 4)
            (q.setdefault("ppl_w8a8", {}) if name.endswith("_w8a8") else out)[f"ppl_{name}"] = ppl
            q["seconds"][name] = round(time.perf_counter() - t0, 1)
            log(f"ppl {name}: {ppl} ({q['seconds'][name]} s)")
    if "ppl_bf16" in out:
        scored = {**out, **q.get("ppl_w8a8", {})}
        q["ratio_to_bf16"] = {k: round(v / out["ppl_bf16"], 5) for k, v in scored.items() if k != "ppl_bf16"}
    q.update(provenance(args.commit), path="CPU, FP8 weights dequantized at load (fp32 math), bf16 in bf16")
    merge_json(args.json, {**out, "quality": q})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="docs/bench/fp8_weights.json")
    ap.add_argument("--commit", default="", help="the commit measured (a copied tree may lack git)")
    ap.add_argument("--steps", type=int, default=30, help="GPU: timed decode steps per 8B figure")
    ap.add_argument("--skip-gemm", action="store_true", help="GPU: without the per-layer GEMM rows (details)")
    ap.add_argument("--ppl", action="store_true", help="CPU: only the perplexity keys, merged into --json")
    ap.add_argument("--formats", default="bf16,fp8_channel,fp8_block", help="8B engines; --ppl rows (or fp32, "
                    "fp8_channel_w8a8, fp8_block_w8a8)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="--ppl: torch CPU threads (1: a shared box)")
    ap.add_argument("--windows", type=int, default=8, help="--ppl: windows of 64 prompt + 256 scored tokens")
    args = ap.parse_args()
    return ppl_main(args, seqs=args.windows) if args.ppl else gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
