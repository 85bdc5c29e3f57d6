"""FP8 weights on the GPU: the activation quantizer kernel against the torch one, the rowwise `_scaled_mm` path,
the block-scaled Triton GEMM and the decode GEMV against dequantized references over decode and prefill shapes
(the GEMV also at the 8B shapes inside a CUDA graph), and the engine with FP8 weights (online and from block /
per-channel checkpoints) eager and through the decode CUDA graphs. CUDA + triton only (the engine tests: sm90 +
FA3); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import forced_logits, random_prompt

from pdserve.engine import kernels
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.quant.fp8_checkpoint import ONLINE_FP8, Fp8Scheme
from pdserve.engine.quant.fp8_convert import convert_checkpoint
from pdserve.engine.quant.fp8_linear import Fp8Linear
from pdserve.engine.quant.fp8_quant import (
    quantize_activations,
    quantize_activations_torch,
    quantize_weight_blocks,
    quantize_weight_per_channel,
)
from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.HAVE_TRITON, reason="needs a CUDA GPU and triton"
)
DEV = torch.device("cuda")
BLOCK = Fp8Scheme(weights="block", block_size=(128, 128), source="fp8")
KW = dict(device="cuda", dtype="bfloat16", page_size=16, chunk_size=48, num_pages=96, max_num_seqs=8, kv_dtype="auto")
PROMPTS = [random_prompt(n, seed=n) for n in (1, 15, 17, 70, 33)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def layer(n: int, k: int, scheme: Fp8Scheme, seed: int, scale_rows: int = 0) -> tuple[Fp8Linear, torch.Tensor]:
    """An Fp8Linear of a random weight [N, K] (and that bf16 weight, the unquantized reference); `scale_rows=1`:
    block scales spread to one per row (the layout of fused parts that do not fill whole blocks)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(n, k, device=DEV, generator=g) * k**-0.5).bfloat16()
    lin = Fp8Linear(k, n, True, scheme, scale_rows).to(DEV)
    q, s = quantize_weight_blocks(w) if scheme.weights == "block" else quantize_weight_per_channel(w)
    if scale_rows == 1:
        s = s.repeat_interleave(128, 0)[:n].contiguous()
    lin.weight.copy_(q)
    lin.weight_scale.copy_(s)
    assert lin.bias is not None
    lin.bias.copy_(torch.randn(n, device=DEV, generator=g) * 0.1)
    return lin, w


@pytest.mark.parametrize("group", [None, 128])
@pytest.mark.parametrize("m, k", [(1, 4096), (16, 14336), (300, 384), (7, 200)])
def test_activation_quantizer_kernel_matches_torch(m, k, group):
    x = (torch.randn(m, k, device=DEV) * torch.rand(m, 1, device=DEV).pow(4) * 30).bfloat16()
    x[0, :64] = 0  # a zero group where group == 128 and k > 128
    q, s = quantize_activations(x, group)  # Triton
    qt, st = quantize_activations_torch(x, group)
    assert torch.equal(s, st)
    mismatched = (q.view(torch.uint8) != qt.view(torch.uint8)).float().mean().item()
    assert mismatched <= 1e-4, mismatched  # same division and rounding: at most a rare last-bit difference


@pytest.mark.parametrize(
    "scheme, gemv_rows, scale_rows, skinny_rows",
    [(ONLINE_FP8, 0, 0, 0), (ONLINE_FP8, 16, 0, 256), (ONLINE_FP8, 0, 0, 256), (BLOCK, 0, 0, 0), (BLOCK, 16, 0, 256),
     (BLOCK, 0, 1, 0), (BLOCK, 16, 1, 256)],
    ids=["scaled_mm", "channel-gemv-skinny", "channel-skinny", "block", "block-gemv-skinny", "block-row-scales",
         "block-row-scales-gemv-skinny"],
)  # fmt: skip
@pytest.mark.parametrize("m", [1, 16, 40, 128, 256, 2048])
@pytest.mark.parametrize("n, k", [(384, 256), (1024, 4096), (4096, 1024)])
def test_fp8_gemm_against_dequantized_references(scheme, gemv_rows, scale_rows, skinny_rows, m, n, k):
    lin, w = layer(n, k, scheme, seed=m + n + k, scale_rows=scale_rows)
    lin.gemv_max_rows = gemv_rows  # 0: quantized activations + a GEMM at every M
    lin.skinny_max_rows = skinny_rows  # 0: _scaled_mm / the block GEMM's prefill tiles, else the split-K GEMM
    x = torch.randn(m, k, device=DEV).bfloat16()
    out = lin(x)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    dequantized = x.float() @ lin.dequantized_weight().t() + lin.bias.float()
    if m <= gemv_rows:  # weight-only GEMV: the dequantized weight times the bf16 activations
        assert rel(out, dequantized) < 1e-2
    else:  # the same quantized operands in float32: only bf16 output rounding and summation order differ
        assert rel(out, lin.reference(x.float())) < 1e-2
        # against the dequantized weight with unquantized bf16 activations: e4m3 rounding of the activations
        assert rel(out, dequantized) < 6e-2
    # against the original bf16 weights: both roundings
    assert rel(out, (x.float() @ w.float().t()) + lin.bias.float()) < 8e-2


def captured(fn):
    """fn() run once eagerly (Triton compiles) on a side stream, then captured in a CUDA graph and replayed:
    (eager result, graph output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return eager, out


def test_fp8_gemm_graph_capturable():
    """Quantize + GEMM (and the GEMV) replay inside a CUDA graph and give the eager result (no host sync)."""
    for scheme, gemv_rows in ((ONLINE_FP8, 0), (ONLINE_FP8, 16), (BLOCK, 0), (BLOCK, 16)):
        lin, _ = layer(512, 256, scheme, seed=1)
        lin.gemv_max_rows = gemv_rows
        x = torch.randn(8, 256, device=DEV).bfloat16()
        eager, out = captured(lambda lin=lin, x=x: lin(x))
        assert torch.equal(out, eager)


@pytest.mark.parametrize("scheme", [ONLINE_FP8, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_fp8_gemv_8b_shapes_in_a_graph(scheme, m):
    """The decode GEMV at the four 8B projections (qkv, o, gate_up, down), captured in one CUDA graph, against the
    dequantized weight times the bf16 activations."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    layers = [layer(n, k, scheme, seed=n + k)[0] for n, k in shapes]
    xs = [torch.randn(m, k, device=DEV).bfloat16() for _, k in shapes]
    eager, outs = captured(lambda: [lin(x) for lin, x in zip(layers, xs)])
    for lin, x, e, out in zip(layers, xs, eager, outs):
        assert torch.equal(out, e)
        assert rel(out, x.float() @ lin.dequantized_weight().t() + lin.bias.float()) < 1e-2


@pytest.mark.parametrize("scheme", [ONLINE_FP8, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fp8_gemv_tc_path_8b_shapes_in_a_graph(scheme, m):
    """Path "tc" (the weight tile as the MMA's rows, float16 operands) at the four 8B projections in one CUDA graph
    with PDL: float32 outputs within float32 rounding of the dequantized weight times the bf16 activations (rows of
    very different sizes each rescaled), and a layer switched to it (`gemv_path`) gives its default path's bf16
    outputs ("stream" at M = 1, "dot" above) to within bf16 rounding; `gemv_bits` gives the float32 products' bits, and
    those are within bf16 rounding of the default (`half` at M = 1)."""
    from pdserve.engine.quant.fp8_gemv import fp8_gemv

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    layers = [layer(n, k, scheme, seed=n + k)[0] for n, k in shapes]
    mags = torch.tensor([1.0, 300.0, 1e-3, 0.0, 1e4], device=DEV)[torch.arange(m, device=DEV) % 5]
    xs = [(torch.randn(m, k, device=DEV) * mags[:, None]).bfloat16() for _, k in shapes]

    def tc(lin, x):
        scale_rows = 0 if lin.block is None else lin.block[0]
        return fp8_gemv(x, lin.weight, lin.weight_scale, lin.bias, scale_rows, torch.float32, path="tc", pdl=True,
                        counters=lin._tickets(x.device))  # fmt: skip

    eager, outs = captured(lambda: [tc(lin, x) for lin, x in zip(layers, xs)])
    for lin, x, e, out in zip(layers, xs, eager, outs):
        assert torch.equal(out, e)
        ref = x.double() @ lin.dequantized_weight(torch.float64).t() + lin.bias.double()
        for i in range(m):  # each row against its own size (the zero row: the bias alone)
            assert (out[i].double() - ref[i]).abs().max() <= 1e-5 * ref[i].abs().max() + 1e-6, (i, mags[i])
        default = lin(x)
        lin.gemv_path = "tc"
        assert rel(lin(x), default) < 1e-2
        lin.gemv_path = "fma"  # at most FMA_MAX_ROWS (4) rows: larger batches keep "auto"
        assert m <= 4 or torch.equal(lin(x), default)
        lin.gemv_path, lin.gemv_bits = "auto", True  # "stream" (M = 1) widened by integer ops: the float32
        widened = lin(x)  # products' bits (the default's `half` yields to it)
        lin.gemv_bits, lin.gemv_half = None, False
        assert torch.equal(widened, lin(x)) and rel(lin(x), default) < 1e-2  # M = 1: the default is `half`
        lin.gemv_half = None


@pytest.mark.parametrize("scheme", [ONLINE_FP8, BLOCK], ids=["channel", "block"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fp8_gemv_half_8b_shapes_in_a_graph(scheme, m):
    """`half` (each run's products and sum in packed float16, RUN_F16_ASM) at the four 8B projections in one CUDA
    graph with PDL: float32 outputs within 2**-8 of the sum of |products| of the float64 reference (rows of very
    different sizes, each run rescaled to float16's range; the zero row gives the bias alone), and not bit for bit
    the float32 path's (another summation: the half path was taken)."""
    from pdserve.engine.quant.fp8_gemv import fp8_gemv

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    layers = [layer(n, k, scheme, seed=n + k + 1)[0] for n, k in shapes]
    mags = torch.tensor([1.0, 300.0, 1e-3, 0.0, 1e4], device=DEV)[torch.arange(m, device=DEV) % 5]
    xs = [(torch.randn(m, k, device=DEV) * mags[:, None]).bfloat16() for _, k in shapes]

    def gemv(lin, x, half):
        scale_rows = 0 if lin.block is None else lin.block[0]
        return fp8_gemv(x, lin.weight, lin.weight_scale, lin.bias, scale_rows, torch.float32, path="stream", pdl=True,
                        half=half, counters=lin._tickets(x.device))  # fmt: skip

    eager, outs = captured(lambda: [gemv(lin, x, True) for lin, x in zip(layers, xs)])
    for lin, x, e, out in zip(layers, xs, eager, outs):
        assert torch.equal(out, e)
        w = lin.dequantized_weight(torch.float64)
        ref = x.double() @ w.t() + lin.bias.double()
        bound = 2**-8 * (x.double().abs() @ w.abs().t()) + 1e-6 * lin.bias.double().abs() + 1e-30
        assert ((out.double() - ref).abs() <= bound).all(), (out.double() - ref).abs().max()
        assert not torch.equal(out, gemv(lin, x, False))


def fp8_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **{**KW, **kw}))


@pytest.fixture(scope="module")
def bf16_reference(checkpoint):
    """bf16 engine on llama_hd64: greedy continuations and their teacher-forced logits."""
    ref = fp8_engine(checkpoint("llama_hd64"))
    forced = [ref.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0] for p in PROMPTS]
    return forced, forced_logits(ref, PROMPTS, forced)


@pytest.mark.parametrize("source", ["online", "block", "channel"])
def test_engine_fp8_weights_graphs_and_eager(checkpoint, tmp_path, bf16_reference, source):
    """FP8 engine: projections are Fp8Linear (e4m3), decode through CUDA graphs equals eager to bf16 rounding,
    and greedy tokens mostly match the bf16 engine's (random tiny model: near-ties flip under FP8 rounding).
    Expected, from the same math emulated on CPU (Fp8Linear.reference in the fp32 engine, these prompts):
    logits rel err 0.118 (per channel) / 0.123 (block) against fp32, argmax agreement 0.78 / 0.77 over the forced
    steps, first greedy token 4/5 / 5/5. Bounds: 0.2, 0.6, 0.6."""
    forced, base = bf16_reference
    src = checkpoint("llama_hd64")
    model_dir = src if source == "online" else convert_checkpoint(src, tmp_path / source, source)
    extra = {"quantization": "fp8"} if source == "online" else {}
    graph = fp8_engine(model_dir, **extra)
    eager = fp8_engine(model_dir, cuda_graphs=False, **extra)
    assert graph.runner.graph_runner is not None and eager.runner.graph_runner is None
    attn = graph.runner.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear) and attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert (attn.qkv_proj.block is not None) == (source == "block")
    lg, le = forced_logits(graph, PROMPTS, forced), forced_logits(eager, PROMPTS, forced)
    assert lg.isfinite().all() and rel(lg, le) < 2e-2
    err = rel(lg, base)
    print(f"{source}: logits rel err vs bf16 {err:.3f}")
    assert err < 0.2
    agree = (lg.argmax(-1) == base.argmax(-1)).float().mean().item()
    assert agree >= 0.6, agree
    greedy = graph.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    first = sum(g[0] == f[0] for g, f in zip(greedy, forced)) / len(forced)
    assert first >= 0.6, first
    assert graph.allocator.num_used == 0


@pytest.mark.parametrize("m", [1, 2, 4, 16])
def test_fp8_gemv_split_k_tickets_pdl_and_sweep_configs(m):
    """The GEMV's one-launch split-K (forced splits; the counters end zero, results equal the unsplit ones to
    fp32 summation order), as a programmatic dependent launch in a graph, and every bench sweep config (of
    bench/fp8_weights.py, and of bench/fp8_gemv_sweep.py on every path that takes M rows; a `bits` config equal to
    the same config's conversion path)."""
    from pdserve.engine.quant.fp8_gemv import PATH_CONFIGS, PATH_MAX_ROWS, SWEEP_CONFIGS, counter_slots, fp8_gemv

    lin, _ = layer(4096, 14336, BLOCK, seed=m)
    x = torch.randn(m, 14336, device=DEV).bfloat16()
    ref = x.float() @ lin.dequantized_weight().t() + lin.bias.float()
    counters = torch.zeros(counter_slots(4096), dtype=torch.int32, device=DEV)
    one = fp8_gemv(x, lin.weight, lin.weight_scale, lin.bias, 128, split=1)
    for split in (2, 7, 28):
        out = fp8_gemv(x, lin.weight, lin.weight_scale, lin.bias, 128, split=split, counters=counters)
        assert rel(out, one) < 1e-2 and rel(out, ref) < 1e-2, split
        assert int(counters.abs().sum()) == 0
    pdl = kernels.pdl_supported(DEV)
    eager, out = captured(lambda: fp8_gemv(x, lin.weight, lin.weight_scale, lin.bias, 128, split=4, pdl=pdl,
                                           counters=counters))  # fmt: skip
    assert torch.equal(out, eager) and int(counters.abs().sum()) == 0
    for cfg in SWEEP_CONFIGS:
        assert rel(fp8_gemv(x, lin.weight, lin.weight_scale, lin.bias, 128, **cfg), ref) < 1e-2, cfg
    for path, configs in PATH_CONFIGS.items():
        for cfg in configs if m <= PATH_MAX_ROWS[path] else []:
            out = fp8_gemv(x, lin.weight, lin.weight_scale, lin.bias, 128, path=path, counters=counters, **cfg)
            assert rel(out, ref) < 1e-2 and int(counters.abs().sum()) == 0, (path, cfg)
            if cfg.get("bits"):  # integer widening: the conversion path's bits (no subnormal flushed on the device)
                conv = {**cfg, "bits": False, "half": False}
                assert torch.equal(out, fp8_gemv(x, lin.weight, lin.weight_scale, lin.bias, 128, path=path, **conv))


@pytest.mark.parametrize("m", [17, 128, 2048])
def test_block_scaled_mm_matches_the_triton_block_gemm(m):
    """Block-scaled layers above the GEMV: cuBLAS's block-scaled `_scaled_mm` (block_backend auto) and the Triton
    block GEMM give the same product of the same quantized operands; auto keeps cuBLAS on an H200 (M = 17 is not
    a shape it takes: the Triton GEMM runs that call, and auto stays)."""
    lin, _ = layer(4096, 1024, BLOCK, seed=m)
    lin.skinny_max_rows = 0  # decode batches would take the split-K Triton GEMM (test below)
    x = torch.randn(m, 1024, device=DEV).bfloat16()
    assert lin._cublas_block_shape(m) == (m % 16 == 0)
    auto = lin(x)
    assert lin.block_backend == "auto", "this torch / GPU refused the block-scaled _scaled_mm"
    lin.block_backend = "triton"
    assert rel(auto, lin(x)) < 1e-2 and rel(auto, lin.reference(x.float())) < 1e-2


@pytest.mark.parametrize("scheme", [ONLINE_FP8, BLOCK], ids=["channel", "block"])
def test_skinny_split_k_gemm_8b_shapes_in_a_graph(scheme):
    """Decode batches above the GEMV (17..256 tokens) at the 8B projections' shapes through Fp8Linear (the split-K
    Triton GEMM where its table says so, cuBLAS elsewhere) equal cuBLAS on the same quantized operands, eager and
    replayed in a CUDA graph, the layer's tickets shared across batch sizes and left zero; then every table entry
    and sweep config of these shapes through the GEMM itself at full and ragged batches."""
    from pdserve.engine.quant import fp8_block_gemm as G

    sys_path_bench()
    from fp8_gemm_sweep import CONFIGS

    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    per_channel = scheme is ONLINE_FP8
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        lin, _ = layer(n, k, scheme, seed=n + k)
        for m in (17, 32, 64, 100, 128, 200, 256):
            x = torch.randn(m, k, device=DEV).bfloat16()
            lin.skinny_max_rows = 0
            cublas = lin(x)  # _scaled_mm (block scales at M = 100 / 200 / 17: the Triton GEMM's default tiles)
            lin.skinny_max_rows = 256
            eager, out = captured(lambda lin=lin, x=x: lin(x))
            assert torch.equal(out, eager), (n, k, m)  # a fixed summation order: the same bits replayed
            assert rel(eager, cublas) < 1e-2, (n, k, m)
            assert lin.gemv_counters is not None and not lin.gemv_counters.any()
        table = {c for (pc, _, n_, k_), c in G.SKINNY_CONFIGS.items() if pc == per_channel and (n_, k_) == (n, k) and c}
        sweep = {c for c in CONFIGS if per_channel or (c[2] == 128 and not c[6])}
        for m in (128, 91):
            x = torch.randn(m, k, device=DEV).bfloat16()
            ref = lin.reference(x.float())
            xq, xs = quantize_activations(x, None if per_channel else 128)
            for c in sorted(table | sweep if m == 128 else table):
                config = G.config_from_tuple(c, m, n, k, sms)
                if per_channel:
                    out = G.channel_gemm(
                        xq, xs, lin.weight, lin.weight_scale, config=config, counters=lin.gemv_counters
                    )
                else:
                    out = G.block_gemm(xq, xs, lin.weight, lin.weight_scale, config=config, counters=lin.gemv_counters)
                assert rel(out + lin.bias, ref) < 1e-2 and not lin.gemv_counters.any(), (n, k, m, c)


def sys_path_bench() -> None:
    """bench/ on sys.path (its sweep's CONFIGS are tested here)."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[3] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_dummy_fp8_engine_from_config_only(checkpoint, tmp_path, fmt):
    """`load_format="dummy"` on CUDA: a directory without weights, FP8 config, e4m3 layers made on the device,
    decode through the graphs equal to eager."""
    import json
    import shutil

    from pdserve.engine.quant.fp8_convert import quantization_config

    src, d = checkpoint("llama_hd64"), tmp_path / "m"
    d.mkdir()
    for f in src.iterdir():
        if not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, d / f.name)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config(fmt)}))
    graph, eager = (fp8_engine(d, load_format="dummy", cuda_graphs=g) for g in (True, False))
    qkv = graph.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.is_cuda and qkv.weight.dtype == torch.float8_e4m3fn
    forced = [random_prompt(12, seed=i) for i in range(len(PROMPTS))]
    lg, le = forced_logits(graph, PROMPTS, forced), forced_logits(eager, PROMPTS, forced)
    assert lg.isfinite().all() and rel(lg, le) < 2e-2
