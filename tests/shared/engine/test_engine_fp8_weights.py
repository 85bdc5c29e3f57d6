"""FP8 weights on CPU: checkpoints in each shipped layout load through the engine's loader and decode
token-identically to transformers on the dequantized weights (fp32); online FP8's error bound; unsupported
variants fail at load naming themselves; Qwen3 exactness; the block-scaled Triton GEMM in Triton's interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_testutil import forced_logits, random_prompt

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loader import model_fingerprint, parse_model_config
from pdserve.engine.quant.fp8_convert import convert_checkpoint
from pdserve.engine.quant.fp8_quant import (
    FP8,
    dequantize_weight,
    quantize_activations_torch,
    quantize_weight_blocks,
    quantize_weight_per_channel,
)
from pdserve.engine.sampling import SamplingParams
from pdserve.models.checkpoints import build_checkpoint

# every projection a whole number of 128-row blocks (q 256, k/v 128, gate/up 384): fusable block scales
SHAPES = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=900 + n) for n in (1, 7, 21)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """models(arch, fmt) -> model dir: the bf16/fp32 source (fmt "src") or its FP8 copy in `fmt`."""
    built: dict = {}

    def get(arch: str, fmt: str = "src"):
        if (arch, fmt) not in built:
            if fmt == "src":
                out = tmp_path_factory.mktemp(f"{arch}_src")
                built[arch, fmt] = build_checkpoint(out, arch=arch, seed=3, **SHAPES)
            else:
                built[arch, fmt] = convert_checkpoint(get(arch), tmp_path_factory.mktemp(arch) / fmt, fmt)
        return built[arch, fmt]

    return get


def engine(model_dir, **kw) -> LLMEngine:
    cfg = {
        **dict(page_size=4, chunk_size=8, num_pages=64, max_num_seqs=4, device="cpu", dtype="float32", kv_dtype="auto"),
        **kw,
    }
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **cfg))


def dequantized_hf(src, fp8_dir):
    """transformers' model of `src` (fp32) with every projection replaced by the FP8 files' weights dequantized
    here (w = q * scale, per channel, per tensor or per 128x128 block)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    params = dict(hf.named_parameters())
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            q = f.get_tensor(name)
            if q.dtype != FP8:
                continue
            prefix = name.removesuffix(".weight")
            n, k = q.shape
            if f"{prefix}.weight_scale_inv" in f.keys():
                s = f.get_tensor(f"{prefix}.weight_scale_inv").repeat_interleave(128, 0)[:n]
                s = s.repeat_interleave(128, 1)[:, :k]
            else:
                s = f.get_tensor(f"{prefix}.weight_scale").float().reshape(-1, 1)
            with torch.no_grad():
                params[name].copy_(q.float() * s)
    return hf


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    hf.generation_config.eos_token_id = None  # full length, like ignore_eos
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY.max_tokens, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


NOISE_MARGIN = 1e-4  # a top-2 logit gap below this is float noise (fp32 logits agree to ~3e-6 here)


def assert_matches_hf(eng: LLMEngine, hf, prompts: list[list[int]]) -> list[list[int]]:
    """The engine's greedy tokens equal transformers' (a divergence is accepted only on a float-noise tie of
    transformers' logits), and its teacher-forced logits along transformers' tokens agree within 1e-4."""
    ours = eng.generate(prompts, GREEDY)
    refs = [hf_greedy(hf, p) for p in prompts]
    for p, o, r in zip(prompts, ours, refs):
        with torch.no_grad():
            ref_logits = hf(torch.tensor([p + r])).logits[0, len(p) - 1 : -1].float()  # [steps, V]
        if o != r:
            j = next(i for i, (a, b) in enumerate(zip(o, r)) if a != b)
            top2 = torch.topk(ref_logits[j], 2).values
            assert float(top2[0] - top2[1]) < NOISE_MARGIN, f"greedy differs at step {j}: {o} vs {r}"
        assert (forced_logits(eng, [p], [r]) - ref_logits).abs().max().item() < 1e-4
    return ours


@pytest.mark.parametrize(
    "arch, fmt", [("llama", "block"), ("qwen3", "block"), ("llama", "channel"), ("qwen3", "tensor")]
)
def test_fp8_checkpoint_greedy_matches_hf_on_dequantized_weights(models, arch, fmt):
    src, fp8 = models(arch), models(arch, fmt)
    mc = parse_model_config(fp8)
    assert mc.quantization is not None and mc.quantization.weights == ("block" if fmt == "block" else "channel")
    assert mc.quantization.activations == ("static" if fmt == "tensor" else "dynamic")
    ours = assert_matches_hf(engine(fp8), dequantized_hf(src, fp8), PROMPTS)
    if fmt == "block":  # transformers loads block-scaled FP8 itself (dequantizing on CPU): the same tokens
        from transformers import AutoModelForCausalLM

        own = AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.float32).eval()
        assert assert_matches_hf(engine(fp8), own, PROMPTS) == ours
    forced = [random_prompt(4, seed=1)]  # the FP8 weights really are what ran: logits differ from the source's
    assert not torch.allclose(
        forced_logits(engine(fp8), PROMPTS[1:2], forced), forced_logits(engine(src), PROMPTS[1:2], forced)
    )


def test_qwen3_matches_hf_exactly(models):
    """Qwen3 (per-head q/k RMSNorm, explicit head_dim, no qkv bias) in fp32, prompts of up to 3 chunks."""
    from transformers import AutoModelForCausalLM

    src = models("qwen3")
    mc = parse_model_config(src)
    assert mc.qk_norm and not mc.qkv_bias and mc.arch == "qwen3"
    assert_matches_hf(engine(src), AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval(), PROMPTS)


def test_online_fp8_logits_close_to_unquantized(models):
    """quantization="fp8" on CPU runs the per-channel e4m3 weights dequantized: the logits move by the weight
    rounding alone. Measured on this shape (llama and qwen3, seeds 3 and 4): relative L2 error 0.080-0.082 for
    fp8 weights, 0.012 for bf16 weights (3 more mantissa bits). Bound: 0.12, and above bf16's."""
    src = models("llama")
    prompts = [random_prompt(n, seed=40 + n) for n in (9, 17)]
    forced = [random_prompt(8, seed=50 + i) for i in range(2)]
    ref = forced_logits(engine(src), prompts, forced)
    fp8 = forced_logits(engine(src, quantization="fp8"), prompts, forced)
    bf16 = forced_logits(engine(src, dtype="bfloat16"), prompts, forced)
    rel = ((fp8 - ref).norm() / ref.norm()).item()
    rel_bf16 = ((bf16.float() - ref).norm() / ref.norm()).item()
    assert rel_bf16 < rel < 0.12, (rel, rel_bf16)


@pytest.mark.parametrize("fmt", ["channel", "block", "online"])
def test_the_gpu_math_on_cpu_quantizes_activations_too(models, fmt):
    """`use_fp8_reference`: the CPU engine's FP8 layers run the GPU path's math (activations quantized per token,
    per 128 columns for block weights) instead of the dequantized weights alone: logits near those, not equal
    (the activation rounding), and every projection an Fp8Linear. Measured on this shape: relative L2 error
    0.077-0.078 against the dequantized weights' logits (as large as the weight rounding's own, 0.08). Bound:
    0.15."""
    from pdserve.engine.quant.fp8_linear import Fp8Linear
    from pdserve.testing.fp8_reference import use_fp8_reference

    src = models("llama")
    model_dir, kw = (src, dict(quantization="fp8")) if fmt == "online" else (models("llama", fmt), {})
    prompts = [random_prompt(n, seed=60 + n) for n in (9, 17)]
    forced = [random_prompt(8, seed=70 + i) for i in range(2)]
    dequantized = forced_logits(engine(model_dir, **kw), prompts, forced)
    emulated = engine(model_dir, **kw)
    layers = use_fp8_reference(emulated)
    assert layers == 4 * emulated.model_config.num_layers  # qkv, o, gate_up, down a layer
    assert sum(isinstance(m, Fp8Linear) for m in emulated.runner.model.modules()) == layers
    w8a8 = forced_logits(emulated, prompts, forced)
    rel = ((w8a8 - dequantized).norm() / dequantized.norm()).item()
    assert 0 < rel < 0.15, rel
    assert use_fp8_reference(engine(src)) == 0  # no FP8 weights: nothing to emulate


def test_fingerprint_and_fp8_checkpoint_with_online_setting(models):
    """Online FP8 is another model for the prompt cache and the P/D pairing (other weights, other KV); an FP8
    checkpoint keeps its own format when quantization="fp8" is also set."""
    src, blk = models("llama"), models("llama", "block")
    assert model_fingerprint(src, "fp8") != model_fingerprint(src) == model_fingerprint(src, "none")
    assert engine(blk, quantization="fp8").generate(PROMPTS, GREEDY) == engine(blk).generate(PROMPTS, GREEDY)


def test_searched_channel_scales_never_add_error_and_usually_remove_some():
    torch.manual_seed(1)
    w = torch.randn(256, 512) * torch.logspace(-2, 1, 256)[:, None]
    plain_q, plain_s = quantize_weight_per_channel(w, search=())
    q, s = quantize_weight_per_channel(w)

    def row_err(q, s):
        return (dequantize_weight(q, s, None, torch.float32) - w).square().sum(1)

    plain, searched = row_err(plain_q, plain_s), row_err(q, s)
    assert (searched <= plain).all()  # 1.0 is one of the factors: a row keeps amax / 448 unless another is better
    assert searched.sum() < 0.97 * plain.sum()
    ratio = s / plain_s
    assert ((ratio > 0.87) & (ratio <= 1.0)).all() and (ratio < 1.0).sum() > 100


def test_quantizers_error_bounds():
    torch.manual_seed(0)
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 300)[:, None]  # rows of very different magnitudes
    q, s = quantize_weight_per_channel(w, search=())  # amax / 448 (the searched scales: the next test)
    assert q.dtype == FP8 and s.shape == (300,)
    err = (dequantize_weight(q, s, None, torch.float32) - w).abs()
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative; subnormals below 2^-6 * scale step by 2^-9 * scale
    assert (err <= w.abs() * 2**-4 + s[:, None] * 2**-10 + 1e-12).all()
    assert torch.allclose(q.float().abs().amax(1), torch.full((300,), 448.0))  # each row uses the whole range
    qb, sb = quantize_weight_blocks(w)
    assert sb.shape == (3, 2)
    errb = (dequantize_weight(qb, sb, (128, 128), torch.float32) - w).abs()
    sfull = sb.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert (errb <= w.abs() * 2**-4 + sfull * 2**-10 + 1e-12).all()
    x = torch.randn(5, 300)
    xq, xs = quantize_activations_torch(x, 128)
    assert xs.shape == (5, 3) and torch.allclose(xs[:, 2], x[:, 256:].abs().amax(1) / 448)
    xq1, xs1 = quantize_activations_torch(x, None)
    assert xs1.shape == (5, 1) and ((xq1.float() * xs1 - x).abs() <= x.abs() * 2**-4 + xs1 * 2**-10).all()


BAD_CONFIGS = [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "without weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "'static'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "'pack-quantized'"),
]


def _ct(weights: dict, acts: dict | None) -> dict:
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False, **weights}
    a = None if acts is None else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, **acts}
    group = {"targets": ["Linear"], "weights": w, "input_activations": a}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}


BAD_CONFIGS += [
    (_ct({"num_bits": 4, "type": "int"}, {}), "type 'int' num_bits 4"),
    (_ct({"strategy": "group", "group_size": 128}, {}), "strategy 'group'"),
    (_ct({}, None), "weight-only FP8"),
    (_ct({}, {"strategy": "tensor", "dynamic": True}), "strategy 'tensor' dynamic=True"),
    ({**_ct({}, {}), "kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
]


@pytest.mark.parametrize("qc, named", BAD_CONFIGS)
def test_unsupported_variants_fail_at_load_naming_them(models, tmp_path, qc, named):
    d = tmp_path / "m"
    shutil.copytree(models("llama", "channel"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(NotImplementedError, match=named):
        engine(d)


def test_bad_quantization_setting():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model_dir="x", quantization="int4").validate()


def test_block_fp8_parts_not_filling_whole_blocks(tmp_path):
    """q of 192 rows (k/v 64, gate/up 320): the fused layers keep one scale per row per 128 columns; the tokens
    still equal transformers' on the dequantized weights."""
    shapes = dict(hidden_size=192, intermediate_size=320, num_attention_heads=3, num_key_value_heads=1)
    src = build_checkpoint(tmp_path / "odd", arch="llama", seed=2, **shapes)
    fp8 = convert_checkpoint(src, tmp_path / "odd_fp8", "block")
    assert_matches_hf(engine(fp8), dequantized_hf(src, fp8), PROMPTS)


INTERPRET_SCRIPT = r"""
import torch
from pdserve.engine.quant.fp8_block_gemm import block_gemm, channel_gemm
from pdserve.engine.quant.fp8_quant import (
    expand_block_scales, quantize_activations_torch, quantize_activations_triton, quantize_weight_blocks,
    quantize_weight_per_channel,
)
def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()
torch.manual_seed(0)
# split: programs along K (the last program of a tile adds the partials); 1152 columns = 9 groups, so 2 or 4
# programs leave the last one fewer steps; BK 256 (per-channel only) with a K tail inside the last step
splits = [dict(BM=32, BN=32, BK=128, GROUP_M=1, split=4), dict(BM=16, BN=64, BK=128, GROUP_M=1, split=2)]
cases = [(3, 200, 320, dict(BM=16, BN=32, GROUP_M=1)), (33, 256, 256, dict(BM=32, BN=64, GROUP_M=2)),
         (1, 128, 384, None), (40, 96, 1152, splits[0]), (17, 136, 1152, splits[1])]
for m, n, k, cfg in cases:
    w, x = torch.randn(n, k), torch.randn(m, k) * 3
    # block scales [ceil(N/128), KG], and the same spread to one scale per row (scale_rows=1)
    wq, ws = quantize_weight_blocks(w)
    xq, xs = quantize_activations_torch(x, 128)
    a = xq.double() * xs.double().repeat_interleave(128, 1)[:, :k]
    ref = a @ (wq.double() * expand_block_scales(ws, n, k, (128, 128)).double()).t()
    err_block = rel(block_gemm(xq, xs, wq, ws, out_dtype=torch.float32, config=cfg), ref)
    per_row = ws.repeat_interleave(128, 0)[:n].contiguous()
    err_rows = rel(block_gemm(xq, xs, wq, per_row, out_dtype=torch.float32, config=cfg, scale_rows=1), ref)
    # per channel: token scales [M, 1], channel scales [N]
    wq, ws = quantize_weight_per_channel(w)
    xq, xs = quantize_activations_torch(x, None)
    ref = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).t()
    err_channel = rel(channel_gemm(xq, xs, wq, ws, out_dtype=torch.float32, config=cfg), ref)
    if cfg and cfg.get("split", 1) > 1:  # per channel: 256 columns a step, 1152 = 4.5 steps
        tickets = torch.zeros(64, dtype=torch.int32)
        for extra in ({"BK": 256}, {"BK": 256}, {"TMA": True}):  # tickets reused (they come back zero); TMA loads
            out = channel_gemm(xq, xs, wq, ws, out_dtype=torch.float32, config={**cfg, **extra}, counters=tickets)
            err_channel = max(err_channel, rel(out, ref))
            assert not tickets.any()
    assert max(err_block, err_rows, err_channel) < 1e-5, (m, n, k, err_block, err_rows, err_channel)
    for group in (None, 128):  # the quantizer kernel's scales (its e4m3 bytes: GPU only, see below)
        assert torch.equal(quantize_activations_triton(x, group)[1], quantize_activations_torch(x, group)[1])
    cm = quantize_activations_triton(x, 128, col_major=True)[1]  # [M, K/128] column-major (_scaled_mm's blocks)
    assert cm.stride(0) == 1 and torch.equal(cm, quantize_activations_torch(x, 128)[1])
    print(m, n, k, f"{err_block:.1e} {err_rows:.1e} {err_channel:.1e}")
"""


def test_block_gemm_in_the_triton_interpreter():
    """The block-scaled GEMM and its per-channel variant (M, N and K tails, several tile shapes, split-K with its
    tickets reused, the per-channel TMA kernel) against the float64 product of the same dequantized operands. The
    interpreter (triton 3.6) loads e4m3 and multiplies it exactly, but its float32 -> e4m3 cast rounds wrongly
    where the mantissa carries into the exponent (7.92 -> 4.0), so the activation quantizer kernel's scales are
    checked here and its bytes on the GPU only (test_engine_gpu_fp8_weights.py)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", INTERPRET_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert len(r.stdout.splitlines()) == 5


GEMV_SCRIPT = r"""
import torch
from pdserve.engine.quant.fp8_gemv import DEFAULT_STREAM, MIN_BLOCK_N, PATH_MAX_ROWS, counter_slots, fp8_gemv
from pdserve.engine.quant.fp8_quant import expand_block_scales, quantize_weight_blocks, quantize_weight_per_channel
def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()
torch.manual_seed(0)
# (M, N, K, split, activation dtype, block_k): N and K not multiples of 128 (tails), a split that leaves the last
# program fewer steps, the split from the SM count (0), no split (1); every path that takes M rows;
# block_k: columns a step of the CUDA-core paths; fp16 stands in for bf16 (the interpreter's bf16 dot is wrong).
# N 136 = 128 + 8: two block rows and a tail at every block_n from 16 up, the fewest programs that do
for m, n, k, split, dt, bk in [(1, 136, 320, 2, torch.float32, 256), (3, 136, 400, 0, torch.float16, 0),
                               (16, 72, 264, 3, torch.float32, 0), (2, 300, 256, 1, torch.float32, 0),
                               (1, 64, 1000, 3, torch.float16, 128), (5, 40, 300, 2, torch.float32, 0)]:
    w, x, b = torch.randn(n, k), (torch.randn(m, k) * 3).to(dt), torch.randn(n)
    wq, ws = quantize_weight_blocks(w)
    ref = x.double() @ (wq.double() * expand_block_scales(ws, n, k, (128, 128)).double()).t() + b.double()
    rows = ws.repeat_interleave(128, 0)[:n].contiguous()  # one scale per row per 128 columns
    cq, cs = quantize_weight_per_channel(w)
    ref_c = x.double() @ (cq.double() * cs.double()[:, None]).t()
    # split-K tickets: one buffer for every call of the case, each call must leave it zero for the next
    counters = torch.zeros(counter_slots(n), dtype=torch.int32)
    # stream also with elementwise accumulators (acc_k) and without the prefetch
    variants = [(p, False, True) for p, most in PATH_MAX_ROWS.items() if m <= most and p != "tc"]  # tc: TC_SCRIPT
    # the stream variants at M = 1 only, the rows "auto" gives them (the interpreter takes ~2 s a call): "auto"'s
    # (acc_k, no prefetch) in both cases, acc_k with the prefetch where a program takes several steps (K 1000 in
    # 128-column steps, split 3: the prefetch loop turns over; at K 320 a program takes one or two)
    extra = [("stream", True, False)] + ([("stream", True, True)] if k > 4 * 128 else []) if m == 1 else []
    for path, acc_k, prefetch in variants + extra:
        # stream: DEFAULT_STREAM's rows a program ("auto"'s launch; its block rows share a scale row), at the
        # smallest N the fewest (MIN_BLOCK_N: as many column tiles as counter_slots gives counters), and 256 (two
        # block rows: per-row scales)
        block_ns = (MIN_BLOCK_N if n < 64 else DEFAULT_STREAM["block_n"], 256) if path == "stream" else (32,)
        kw = dict(block_k=bk, split=split, counters=counters, path=path, acc_k=acc_k, prefetch=prefetch)
        calls = [(wq, ws, b, 128, bn, ref) for bn in block_ns]
        calls += [(wq, rows, b, 1, block_ns[0], ref), (cq, cs, None, 0, 16, ref_c)]
        errs = []
        for wt, sc, bias, scale_rows, bn, want in calls:
            errs.append(rel(fp8_gemv(x, wt, sc, bias, scale_rows, torch.float32, block_n=bn, **kw), want))
            assert int(counters.abs().sum()) == 0, (m, n, k, path, bn, counters)
        assert max(errs) < 1e-5, (m, n, k, path, errs)
        print(m, n, k, path, acc_k, prefetch, " ".join(f"{e:.1e}" for e in errs))
"""


def test_fp8_gemv_in_the_triton_interpreter():
    """The decode GEMV (weight-only dequantization, one-launch split-K) with block, per-row and per-channel scales
    at M = 1, 2, 3, 5, 16 on every path that takes M rows (CUDA-core "stream", also with acc_k and without the
    prefetch, and "fma", tensor-core "dot") against the float64 product of the unquantized activations and the
    dequantized weight."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", GEMV_SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    # per case: the paths taking M rows (stream, dot; fma up to 4 rows), and stream once more at M = 1 (twice at K 1000)
    assert len(r.stdout.splitlines()) == sum(2 + (m <= 4) + (m == 1) for m in (1, 3, 16, 2, 1, 5)) + 1, r.stdout


BITS_SCRIPT = r"""
import torch
from pdserve.engine.quant.fp8_gemv import fp8_gemv
torch.manual_seed(0)
# every finite e4m3 code (subnormals, +-0; not the two NaNs) in each row, shuffled; x over 2**-30 .. 2**20
codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
for m, n, k, split in [(1, 136, 1000, 3), (3, 40, 300, 1)]:
    w = codes[torch.randint(len(codes), (n, k))].view(torch.float8_e4m3fn)
    x = torch.randn(m, k) * torch.exp2(torch.randint(-30, 21, (m, k)).float())
    kw = dict(path="stream", split=split, block_n=8, block_k=128, acc_k=False, prefetch=True)
    for scale, scale_rows in [(torch.rand(n) + 0.5, 0), (torch.rand(-(-n // 128), -(-k // 128)) + 0.5, 128),
                              (torch.rand(n, -(-k // 128)) + 0.5, 1)]:
        ref = fp8_gemv(x, w, scale, None, scale_rows, torch.float32, bits=False, **kw)
        out = fp8_gemv(x, w, scale, None, scale_rows, torch.float32, bits=True, **kw)
        assert torch.isfinite(ref).all() and torch.equal(out, ref), (m, n, k, scale_rows, (out - ref).abs().max())
        print(m, n, k, scale_rows, "equal")
"""


def test_fp8_gemv_bits_equals_the_conversion_path():
    """The "stream" path's `bits` widening (integer ops, powers of two around it) gives the conversion path's result
    bit for bit over every finite e4m3 code, subnormals included, and activations from 2**-30 to 2**20."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", BITS_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("equal") == 6, r.stdout


TC_SCRIPT = r"""
import torch
from pdserve.engine.quant.fp8_gemv import fp8_gemv
from pdserve.engine.quant.fp8_quant import expand_block_scales, quantize_weight_blocks, quantize_weight_per_channel
torch.manual_seed(0)
# path "tc" (16-bit x): M 1, 3, 16; N and K tails; split-K; rows of very different magnitudes (each row's own power
# of two), one all zero, one of ~1e36 (outputs near float32's largest), one tiny (~2**-115: rescaled by the most,
# 2**126; float32 subnormals stay out: the interpreter multiplies them wrongly)
for m, n, k, split, dt in [(1, 136, 320, 2, torch.float16), (3, 72, 1000, 3, torch.bfloat16),
                           (16, 200, 264, 0, torch.bfloat16), (5, 64, 384, 1, torch.float16)]:
    w = torch.randn(n, k)
    mags = torch.tensor([1.0, 3e4, 1e-3, 0.0, 2.0**-115, 1e36])[torch.arange(m) % 6].double()
    if dt == torch.float16:
        mags = mags.clamp(min=1e-4, max=1e4) * (mags > 0)
    # |x| in [mags, 2 mags): the tiny row keeps clear of float32's subnormals
    x = ((torch.rand(m, k).double() + 1) * torch.randn(m, k).sign().double() * mags[:, None]).to(dt)
    wq, ws = quantize_weight_blocks(w)
    cq, cs = quantize_weight_per_channel(w)
    rows = ws.repeat_interleave(128, 0)[:n].contiguous()
    dense_b = wq.double() * expand_block_scales(ws, n, k, (128, 128)).double()
    dense_c = cq.double() * cs.double()[:, None]
    for wt, sc, scale_rows, dense, bn in [(wq, ws, 128, dense_b, 64), (wq, rows, 1, dense_b, 128),
                                          (cq, cs, 0, dense_c, 64)]:
        y = fp8_gemv(x, wt, sc, None, scale_rows, torch.float32, path="tc", split=split, block_n=bn).double()
        ref = x.double() @ dense.t()
        for i in range(m):  # per row: relative to the row's own size (row 3 is all zero: exactly zero)
            err = (y[i] - ref[i]).abs().max().item() / max(ref[i].abs().max().item(), 1e-300)
            assert (err < 1e-5) if ref[i].abs().max() > 0 else y[i].abs().max() == 0, (m, n, k, scale_rows, i, err)
        print(m, n, k, scale_rows, "ok")
try:
    fp8_gemv(torch.zeros(1, 256), cq[:, :256].contiguous(), cs, path="tc")
except AssertionError as e:
    print("refused:", e)
"""


def test_fp8_gemv_tc_path_in_the_triton_interpreter():
    """Path "tc" (weights as the MMA's rows, float16 operands, a power of two per x row and step) equals the float64
    product of x and the dequantized weight within float32 rounding, per row, over rows of 1e-3 to 1e36, zero rows
    and rows of ~2**-115; float32 x is refused."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", TC_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count(" ok") == 12 and "refused: path 'tc' takes 16-bit x" in r.stdout, r.stdout


def test_fp8_gemv_auto_path_by_rows():
    """ "auto": the streaming CUDA-core path up to AUTO_STREAM_ROWS rows, then "fma" up to AUTO_FMA_ROWS, then the
    tensor cores ("dot"); an explicit path past its most rows is refused."""
    pytest.importorskip("triton")
    from pdserve.engine.quant import fp8_gemv as G

    for m in range(1, G.MAX_M + 1):
        want = "stream" if m <= G.AUTO_STREAM_ROWS else "fma" if m <= G.AUTO_FMA_ROWS else "dot"
        assert G.choose_path("auto", m) == want and G.choose_path("dot", m) == "dot"
        assert G.choose_path("tc", m) == "tc"
    with pytest.raises(AssertionError):
        G.choose_path("fma", G.FMA_MAX_ROWS + 1)


def test_fp8_gemv_half_compiles_for_hopper_with_a_shorter_k_loop(tmp_path):
    """The "stream" GEMV's `half` path compiles for sm_90 on this GPU-less host (ptxas takes RUN_F16_ASM; Triton's
    interpreter cannot run inline PTX, so this is its CPU check) with no local memory, converts each e4m3 pair once
    (F2FP) and multiplies in packed float16, and its K loop issues well under the conversion path's instructions
    per weight byte (bench/diag/gemv_sass.py prints both)."""
    pytest.importorskip("triton")
    script = Path(__file__).resolve().parents[3] / "bench" / "diag" / "gemv_sass.py"
    spec = importlib.util.spec_from_file_location("gemv_sass", script)
    gemv_sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gemv_sass)
    conv, half = (gemv_sass.analyse(v, 8, 1024, 4, 3, tmp_path) for v in ("conv", "half"))
    sass = (tmp_path / "stream_half.sass").read_text()
    assert half["local_memory"] == 0 and "F2FP.F16.E4M3.UNPACK_B" in sass and "HFMA2" in sass, half
    assert half["loop_instructions"] < 0.7 * conv["loop_instructions"], (half, conv)
