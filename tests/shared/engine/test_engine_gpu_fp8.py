"""fp8 (e4m3fn) KV on the GPU: the Triton quantizer and the fused RoPE + KV write equal the CPU torch path bit for
bit, the fp8 paged decode kernel matches fp32 attention over the dequantized pages, and the GPU engine with an fp8
pool (CUDA graphs, both decode kernels) matches its eager run and an fp32 reference. CUDA + triton only (the
engine tests: sm90 + FA3); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import assert_gathered, forced_logits, random_prompt, ref_paged_decode

from pdserve.engine import kernels
from pdserve.engine.kernel_choice import KernelChoice
from pdserve.engine.sampling import SamplingParams
from pdserve.kv import quant as Q

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.HAVE_TRITON, reason="needs a CUDA GPU and triton"
)
DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def awkward(shape, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows over many magnitudes, plus a zero row, a constant group, tiny (subnormal-range) values."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(*shape, device=DEV, generator=g) * torch.rand(*shape[:-1], 1, device=DEV, generator=g).pow(4) * 50
    x[0, 0] = 0
    x[1, 1] = 2.5
    x[2, 2, :8] = 1e-4
    return x.to(dtype)


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_quantize_matches_cpu_path_bitwise(group, dtype):
    x = awkward((37, 8, 128), group, dtype)
    kc = KernelChoice(triton_kv_quant=True)  # what the GPU engine's pool quantizes with
    q, s, z = kc.quantize(x, group, False, FP8)  # dispatches to triton on CUDA
    qc, sc, zc = Q.quantize(x.cpu(), group, False, FP8)
    assert z is None and zc is None
    assert same_bytes(q, qc) and torch.equal(s.cpu(), sc)
    for out_dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(
            kc.dequantize(q, s, None, group, out_dtype).cpu(), Q.dequantize(qc, sc, None, group, out_dtype)
        )


@pytest.mark.xfail(
    reason="known (issue 14): torch's own fp8 quantize on CUDA (the fallback when Triton is off) differs from the CPU "
    "path for bf16 input with fp16-subnormal scales (H200, 2026-12-01: 50 scales, 27 bytes of 37x8x128); the engine "
    "quantizes through Triton on CUDA, which matches",
    strict=False,
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_torch_quantize_on_cuda_matches_cpu_path(dtype):
    x = awkward((37, 8, 128), 64, dtype)
    qt, st, _ = Q.quantize(x, 64, False, FP8)
    qc, sc, _ = Q.quantize(x.cpu(), 64, False, FP8)
    assert same_bytes(qt, qc) and torch.equal(st.cpu(), sc)


def test_fp8_quantize_fast_division_is_bit_equal():
    from pdserve.engine.kernels import kv_quant

    x = awkward((1 << 14, 4, 128), 5, torch.float32)
    a = kv_quant.quantize(x, 128, False, fast_div=False, fp8=True)
    b = kv_quant.quantize(x, 128, False, fast_div=True, fp8=True)
    assert same_bytes(a[0], b[0]) and torch.equal(a[1], b[1])


def test_rope_kv_write_fp8_stores_what_the_torch_path_stores():
    from pdserve.engine.kernels.rope_kv_write import rope_kv_write
    from pdserve.engine.model import RotaryEmbedding

    g = torch.Generator(device=DEV).manual_seed(4)
    T, H, KVH, D, P, ps = 50, 32, 8, 128, 16, 16
    rot = RotaryEmbedding(D, 500000.0, None, DEV)
    rot.build_tables(4096)
    pos = torch.randint(0, 4096, (T,), device=DEV, generator=g)
    qkv = (torch.randn(T, (H + 2 * KVH) * D, device=DEV, generator=g) * 3).bfloat16()
    q, k, v = (
        qkv[:, : H * D].view(T, H, D),
        qkv[:, H * D : (H + KVH) * D].view(T, KVH, D),
        qkv[:, (H + KVH) * D :].view(T, KVH, D),
    )
    slots = torch.randperm(P * ps, device=DEV, generator=g)[:T]
    slots[3] = -1  # a padded row: rotated, not written
    data = lambda: torch.zeros(P, ps, KVH, D, dtype=FP8, device=DEV)  # noqa: E731
    ones = lambda: torch.ones(P, ps, KVH, 1, dtype=torch.float16, device=DEV)  # noqa: E731
    pool = (data(), data(), ones(), ones(), None, None)  # one scale per (token, KV head), as the engine's fp8 pool
    rope_kv_write(pos, q, k, v, rot.cos, rot.sin, slots, pool)
    ok = slots >= 0
    kq, vq, ks, vs = pool[:4]
    for stored, scales, src in ((kq, ks, k), (vq, vs, v)):  # k is rotated in place: the bf16 k the torch path sees
        eq, es, _ = Q.quantize(src[ok].cpu(), D, False, FP8)
        assert same_bytes(stored.view(-1, KVH, D)[slots[ok]], eq)
        assert torch.equal(scales.view(-1, KVH, 1)[slots[ok]].cpu(), es)
    untouched = torch.ones(P * ps, dtype=torch.bool, device=DEV)
    untouched[slots[ok]] = False
    assert (kq.view(-1, KVH, D)[untouched].float() == 0).all()


def test_dequant_pages_fp8_matches_pool_read():
    from pdserve.engine.kernels.kv_gather import dequant_pages

    g = torch.Generator(device=DEV).manual_seed(1)
    P, ps, H, D = 64, 16, 8, 128
    q, s, _ = Q.quantize(torch.randn(2, P, ps, H, D, device=DEV, generator=g), D, False, FP8)
    table = torch.randperm(P, device=DEV, generator=g)[:40].view(4, 10).int()
    lens = torch.tensor([1, 17, 160, 77], device=DEV, dtype=torch.int32)
    out = dequant_pages(q, s, None, table, lens, torch.bfloat16)
    full = Q.dequantize(q, s, None, D, torch.bfloat16).view(2, P * ps, H, D)
    assert_gathered(out, full, table, lens, ps)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("hq", [32, 8])  # GQA 4 and MHA
def test_fp8_decode_attention_vs_fp64(splits, pdl, hq):
    from pdserve.engine.kernels.fp8_decode_attention import fp8_paged_decode

    if pdl and not kernels.pdl_supported(DEV):
        pytest.skip("programmatic dependent launch needs sm90+")
    g = torch.Generator(device=DEV).manual_seed(splits + 7 * pdl + hq)
    P, ps, KVH, D, B, W = 256, 16, 8, 128, 5, 40
    q8, s, _ = Q.quantize(torch.randn(2, P, ps, KVH, D, device=DEV, generator=g) * 2, D, False, FP8)
    kv = Q.dequantize(q8, s, None, D, torch.float32).view(2, P * ps, KVH, D)  # what the kernel must attend to
    table = torch.randperm(P, device=DEV, generator=g)[: B * W].view(B, W).int()
    lens = torch.tensor([1, 15, 16, 333, 640], device=DEV, dtype=torch.int32)
    q = torch.randn(B, hq, D, device=DEV, generator=g).bfloat16()
    out = fp8_paged_decode(q, q8[0], q8[1], s[0], s[1], table, lens, D**-0.5, splits, pdl=pdl)
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
    assert rel(out, ref_paged_decode(q, kv, table, lens, ps, D**-0.5)) < 1e-2


# ---- the engine --------------------------------------------------------------------------------------------------
KW = dict(
    device="cuda", dtype="bfloat16", attention_backend="fa3", page_size=16, chunk_size=48, num_pages=96, max_num_seqs=8
)
PROMPTS = [random_prompt(n, seed=n) for n in (1, 15, 16, 17, 70, 33)]


@pytest.fixture(scope="module")
def reference(make_engine):
    """fp32 SDPA engine (full-precision KV): greedy continuations and their logits."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the GPU engine path (FA3) needs sm90")
    ref = make_engine("llama_hd64", **{**KW, "attention_backend": "sdpa", "dtype": "float32"})
    forced = [
        ref.generate([p], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0]
        for p, n in zip(PROMPTS, (20, 7, 33, 12, 25, 18))
    ]
    return forced, forced_logits(ref, PROMPTS, forced)


@pytest.mark.parametrize("decode_kernel", ["triton", "dequant"])
def test_fp8_engine_graph_matches_eager_and_fp32(make_engine, reference, decode_kernel):
    forced, base = reference
    extra = dict(kv_dtype="fp8", int8_decode_kernel=decode_kernel)
    eager = make_engine("llama_hd64", **KW, **extra, cuda_graphs=False)
    if eager.runner.backend.name != "fa3":
        pytest.skip("FA3 unavailable")
    graph = make_engine("llama_hd64", **KW, **extra)
    assert eager.runner.kv_cache.data.dtype == FP8 and eager.runner.kv_group_size == 64  # one scale per head
    assert graph.runner.graph_runner is not None
    le, lg = forced_logits(eager, PROMPTS, forced), forced_logits(graph, PROMPTS, forced)
    assert eager.allocator.num_used == 0 and graph.allocator.num_used == 0
    assert lg.isfinite().all()
    assert ((lg - le).norm() / le.norm()).item() < 2e-2  # same kernels, GEMM shapes differ (padded graph batches)
    sdpa = make_engine("llama_hd64", **{**KW, "attention_backend": "sdpa"}, **extra)  # unfused torch path, fp8 KV
    err_ref = (forced_logits(sdpa, PROMPTS, forced) - base).abs().max().item()
    err = (lg - base).abs().max().item()
    print(f"fp8-{decode_kernel}: max |logit - fp32| graph {err:.3f}, unfused sdpa-bf16 {err_ref:.3f}")
    assert err <= 2 * err_ref + 0.05
