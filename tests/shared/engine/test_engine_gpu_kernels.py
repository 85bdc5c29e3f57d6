"""Triton kernels of the GPU engine against references, on fresh random inputs (CUDA + triton only; skipped
elsewhere: CPU CI has neither). Quantization must equal the CPU torch path bit for bit; float kernels are held to
an fp32 reference with bf16-level tolerances (relative L2 error)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_testutil import assert_gathered, ref_paged_decode

from pdserve.engine import kernels
from pdserve.engine.kernel_choice import KernelChoice
from pdserve.kv import quant as Q

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.HAVE_TRITON, reason="needs a CUDA GPU and triton"
)
DEV = torch.device("cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_matches_cpu_path_bitwise(asym, group, dtype):
    g = torch.Generator(device=DEV).manual_seed(group + asym)
    x = torch.randn(37, 8, 128, device=DEV, generator=g) * torch.rand(37, 8, 1, device=DEV, generator=g) * 20
    x = x.to(dtype)
    x[0, 0] = 0
    x[1, 1, :group] = 2.5  # constant group
    kc = KernelChoice(triton_kv_quant=True)  # what the GPU engine's pool quantizes with
    q, s, z = kc.quantize(x, group, asym)  # dispatches to triton on CUDA
    qc, sc, zc = Q.quantize(x.cpu(), group, asym)
    assert torch.equal(q.cpu(), qc) and torch.equal(s.cpu(), sc)
    assert (z is None) == (zc is None) and (z is None or torch.equal(z.cpu(), zc))
    for out_dtype in (torch.float32, torch.bfloat16):
        d = kc.dequantize(q, s, z, group, out_dtype)
        assert torch.equal(d.cpu(), Q.dequantize(qc, sc, zc, group, out_dtype))
    # against the exact value: error at most half a (stored) scale step per element
    err = (Q.dequantize(q, s, z, group, torch.float32) - x.float()).abs().view(37, 8, -1, group)
    assert (err <= s.float()[..., None] * 0.5 + 1e-6 * x.float().abs().max()).all()


@pytest.mark.parametrize("asym", [False, True])
def test_quantize_fast_division_is_bit_equal(asym):
    from pdserve.engine.kernels import kv_quant

    g = torch.Generator(device=DEV).manual_seed(5 + asym)
    x = torch.randn(1 << 16, 128, device=DEV, generator=g) * torch.rand(1 << 16, 1, device=DEV, generator=g) * 50
    a = kv_quant.quantize(x, 64, asym, fast_div=False)
    b = kv_quant.quantize(x, 64, asym, fast_div=True)
    assert all(torch.equal(u, v) for u, v in zip(a, b) if u is not None)


@pytest.mark.parametrize("pdl", [False, True])
def test_gemv_vs_fp64(pdl):
    from pdserve.engine.kernels.gemv import gemv
    from pdserve.engine.kernels.silu_mul import silu_mul

    if pdl and not kernels.pdl_supported(DEV):
        pytest.skip("programmatic dependent launch needs sm90+")
    g = torch.Generator(device=DEV).manual_seed(6)
    w = torch.randn(1000, 4100, device=DEV, generator=g).bfloat16()  # ragged N and K
    b = torch.randn(1000, device=DEV, generator=g).bfloat16()
    for m in (1, 2, 4):
        x = torch.randn(m, 4100, device=DEV, generator=g).bfloat16()
        assert rel(gemv(x, w, b, pdl=pdl), x.double() @ w.double().T + b.double()) < 1e-2
        # SwiGLU fused into the load: bit-equal to the separate activation kernel, then the GEMV
        gu = torch.randn(m, 2 * 4100, device=DEV, generator=g).bfloat16()
        assert torch.equal(gemv(gu, w, b, act="silu_mul", pdl=pdl), gemv(silu_mul(gu), w, b))
        for cfg in (dict(block_n=8, block_k=2048), dict(block_n=32, block_k=512, num_stages=3)):
            assert rel(gemv(x, w, None, pdl=pdl, **cfg), x.double() @ w.double().T) < 1e-2


def test_pdl_chain_in_a_cuda_graph_matches_plain_launches():
    """A dependent chain of PDL kernels (GEMV -> RMSNorm with residual -> GEMV + SwiGLU -> RMSNorm), captured in a
    CUDA graph and replayed many times, equals the same chain without PDL bit for bit: every kernel waits for
    its predecessor before touching activations."""
    from pdserve.engine.kernels.gemv import gemv
    from pdserve.engine.kernels.rmsnorm import rmsnorm

    if not kernels.pdl_supported(DEV):
        pytest.skip("programmatic dependent launch needs sm90+")
    g = torch.Generator(device=DEV).manual_seed(7)
    h, f = 1024, 2816
    w1 = torch.randn(2 * f, h, device=DEV, generator=g).bfloat16() * 0.05
    w2 = torch.randn(h, f, device=DEV, generator=g).bfloat16() * 0.05
    nw = (1 + 0.1 * torch.randn(h, device=DEV, generator=g)).bfloat16()
    x0 = torch.randn(2, h, device=DEV, generator=g).bfloat16()

    def chain(x, res, pdl):
        for _ in range(4):
            a = gemv(x, w1, pdl=pdl)
            y = gemv(a, w2, act="silu_mul", pdl=pdl)
            x = rmsnorm(y, nw, 1e-5, res, pdl=pdl)
        return x

    outs = {}
    for pdl in (False, True):
        res = x0.clone()
        chain(x0, res, pdl)  # compile outside the capture
        res.copy_(x0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x0, res, pdl)
        results = []
        for _ in range(20):
            res.copy_(x0)
            graph.replay()
            results.append((out.clone(), res.clone()))
        outs[pdl] = results
    for (a, ra), (b, rb) in zip(outs[False], outs[True]):
        assert torch.equal(a, b) and torch.equal(ra, rb)


def test_argmax_rows_equals_torch_ties_included():
    from pdserve.engine.kernels.argmax import argmax_rows

    g = torch.Generator(device=DEV).manual_seed(8)
    for v in (128256, 5000, 151936, 65536 + 3):
        x = torch.randn(37, v, device=DEV, generator=g)
        assert torch.equal(argmax_rows(x), x.argmax(-1))
        ties = torch.randint(0, 4, (37, v), device=DEV, generator=g).float()  # every row: thousands of maxima
        assert torch.equal(argmax_rows(ties), ties.argmax(-1))
        ties[5, -1] = 9.0
        ties[6, 0] = 9.0
        assert torch.equal(argmax_rows(ties), ties.argmax(-1))
        logits = torch.randn(3, v, device=DEV, generator=g).bfloat16().float()  # bf16-rounded: near-ties
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))


def test_dequant_pages_matches_pool_read():
    from pdserve.engine.kernels.kv_gather import dequant_pages

    g = torch.Generator(device=DEV).manual_seed(1)
    P, ps, H, D = 64, 16, 8, 128
    for asym in (False, True):
        q, s, z = Q.quantize(torch.randn(2, P, ps, H, D, device=DEV, generator=g), 64, asym)
        table = torch.randperm(P, device=DEV, generator=g)[:40].view(4, 10).int()
        lens = torch.tensor([1, 17, 160, 77], device=DEV, dtype=torch.int32)
        out = dequant_pages(q, s, z, table, lens, torch.bfloat16)
        full = Q.dequantize(q, s, z, 64, torch.bfloat16).view(2, P * ps, H, D)
        assert_gathered(out, full, table, lens, ps)


def test_words_to_f16_exact():
    """The byte-permute int8 -> fp16 conversion of the fold2 kernel (int8 rows read as int32 words) gives every int8
    value exactly, in order, in any tile shape."""
    import triton
    import triton.language as tl

    from pdserve.engine.kernels.int8_fold2_decode import _load_words_f16

    @triton.jit
    def convert(x_ptr, y_ptr, R: tl.constexpr, C: tl.constexpr):
        rows = tl.arange(0, R)
        words = x_ptr + rows[:, None] * (C // 4) + tl.arange(0, C // 4)[None, :]  # [R, C/4] int32
        off = rows[:, None] * C + tl.arange(0, C)[None, :]
        tl.store(y_ptr + off, _load_words_f16(words, rows < R, R, C))

    for r, c in ((16, 16), (64, 64), (128, 64)):
        x = torch.arange(r * c, device=DEV).remainder(256).sub(128).to(torch.int8).view(r, c)
        x = x[:, torch.randperm(c, device=DEV)].contiguous()
        y = torch.empty(r, c, dtype=torch.float16, device=DEV)
        convert[(1,)](x.view(torch.int32), y, R=r, C=c)
        assert torch.equal(y, x.half())


# (kernel the pool's shape picks, head_dim, group size, asymmetric, launch); "lean" pools at every launch shape
INT8_DECODE_CASES = {
    "lean": ("planes", 128, 64, False, {}),  # the default: int8_planes_decode.py, DEFAULT_CONFIG's one warp
    "lean-pdl": ("planes", 128, 64, False, {"pdl": True}),
    "lean-w4": ("planes", 128, 64, False, {"num_warps": 4}),  # a decode_kernel_config override
    "lean-tile-launch": ("planes", 128, 64, False, {"block_n": 128, "num_warps": 4}),
    "fold2": ("fold2", 64, 32, False, {"block_n": 128, "num_warps": 4}),  # two groups below head_dim 128
    "fold2-pdl": ("fold2", 64, 32, False, {"block_n": 128, "num_warps": 4, "pdl": True}),
    "tile-asym": ("tile", 128, 64, True, {"block_n": 128, "num_warps": 4}),  # asymmetric: the tile kernel
    "tile-4groups": ("tile", 128, 32, False, {"block_n": 128, "num_warps": 4}),
    "tile-1group": ("tile", 64, 64, False, {"block_n": 128, "num_warps": 4}),
}


@pytest.mark.parametrize("case", list(INT8_DECODE_CASES))
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_int8_decode_attention_vs_fp32(splits, case):
    """Every kernel `int8_paged_decode` picks by the pool's shape (int8_decode_attention's docstring), at its own
    launch and at others a decode_kernel_config may set, against fp32 attention over the dequantized pages."""
    from pdserve.engine.kernels.int8_decode_attention import int8_paged_decode, reads_planes

    kernel, D, group, asym, launch = INT8_DECODE_CASES[case]
    assert reads_planes(D, D // group, asym) == (kernel == "planes")
    g = torch.Generator(device=DEV).manual_seed(splits + 10 * asym + D)
    P, ps, KVH, HQ, B, W = 256, 16, 8, 32, 5, 40
    q8, s, z = Q.quantize(torch.randn(2, P, ps, KVH, D, device=DEV, generator=g), group, asym)
    kv = Q.dequantize(q8, s, z, group, torch.float32).view(2, P * ps, KVH, D)  # what the kernel must attend to
    table = torch.randperm(P, device=DEV, generator=g)[: B * W].view(B, W).int()
    lens = torch.tensor([1, 15, 16, 333, 640], device=DEV, dtype=torch.int32)
    q = torch.randn(B, HQ, D, device=DEV, generator=g).bfloat16()
    kw = dict(launch)
    kw["pdl"] = kw.get("pdl", False) and kernels.pdl_supported(DEV)
    out = int8_paged_decode(
        q,
        q8[0],
        q8[1],
        s[0],
        s[1],
        None if z is None else z[0],
        None if z is None else z[1],
        table,
        lens,
        D**-0.5,
        splits,
        **kw,
    )
    assert out.isfinite().all()
    assert rel(out, ref_paged_decode(q, kv, table, lens, ps, D**-0.5)) < 1e-2


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("data", ["rising", "rising-large-v", "normal"])
def test_int8_lean_loop_vs_fp64_on_moving_maxima(splits, data):
    """The lean loop (int8_planes_decode) against fp64 attention on data that moves the running max many times
    (scores rising along the sequence: lazy rescales taken), the same with V large enough that fp16 P * v_scale
    overflows unless the max follows the scores, and plain data; lengths 1, a page, block edges, long."""
    from pdserve.engine.kernels.int8_decode_attention import int8_paged_decode

    g = torch.Generator(device=DEV).manual_seed(7 + splits)
    ps, KVH, D, HQ, W = 16, 8, 128, 32, 1024
    lens = torch.tensor([1, 16, 31, 32, 33, 64, 1000, 2047, 8191, 16384], device=DEV, dtype=torch.int32)
    B = len(lens)
    P = B * W
    k = torch.randn(P, ps, KVH, D, device=DEV, generator=g)
    v = torch.randn(P, ps, KVH, D, device=DEV, generator=g)
    q = torch.randn(B, HQ, D, device=DEV, generator=g)
    table = torch.randperm(P, device=DEV, generator=g).view(B, W).int()
    if data.startswith("rising"):  # the score of position t grows ~0.8 log2 units per 32-key block: many rescales
        rows = (table.long()[:, :, None] * ps + torch.arange(ps, device=DEV)).view(B, W * ps)  # pool row of each t
        pos = torch.zeros(P * ps, device=DEV)
        pos[rows] = torch.arange(W * ps, device=DEV, dtype=torch.float32).expand(B, -1)
        u = torch.randn(D, device=DEV, generator=g)
        u = u / u.norm()
        q = 4 * u + 0.1 * q
        k = 0.1 * k + (0.05 * pos).view(P, ps, 1, 1) * u
    if data.endswith("large-v"):
        v = v * 3000.0  # scales ~100: fp16 P * scale stays finite only within the lazy bound
    q8, s, _ = Q.quantize(torch.stack([k, v]), 64, False)
    q = q.bfloat16()
    out = int8_paged_decode(q, q8[0], q8[1], s[0], s[1], None, None, table, lens, D**-0.5, splits)  # the lean loop
    assert out.isfinite().all()
    kvf = Q.dequantize(q8, s, None, 64, torch.float32).view(2, P * ps, KVH, D)
    exact = ref_paged_decode(q, kvf, table, lens, ps, D**-0.5)
    for i in range(B):  # per sequence: the offsets' drift grew with the length before the flushes (5e-2 at 8k)
        assert rel(out[i], exact[i]) < 5e-3, i


def test_rmsnorm_silu_vs_fp32():
    from pdserve.engine.kernels.rmsnorm import rmsnorm
    from pdserve.engine.kernels.silu_mul import silu_mul

    g = torch.Generator(device=DEV).manual_seed(2)
    x = torch.randn(300, 4096, device=DEV, generator=g).bfloat16()
    r = torch.randn(300, 4096, device=DEV, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(4096, device=DEV, generator=g)).bfloat16()
    ref = lambda t: w.double() * t.double() * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-5)  # noqa: E731
    assert rel(rmsnorm(x, w, 1e-5), ref(x)) < 1e-2
    res = r.clone()
    h = rmsnorm(x, w, 1e-5, res)
    assert torch.equal(res, x + r) and rel(h, ref(x.double() + r.double())) < 1e-2
    gu = torch.randn(300, 2 * 1000, device=DEV, generator=g).bfloat16()
    ref = F.silu(gu[:, :1000].double()) * gu[:, 1000:].double()
    assert rel(silu_mul(gu), ref) < 1e-2


@pytest.mark.parametrize("int8", [False, True])
def test_rope_kv_write_vs_fp32(int8):
    from pdserve.engine.kernels.rope_kv_write import rope_kv_write
    from pdserve.engine.model import RotaryEmbedding

    g = torch.Generator(device=DEV).manual_seed(3 + int8)
    T, H, KVH, D, P, ps = 50, 32, 8, 128, 16, 16
    rot = RotaryEmbedding(D, 500000.0, None, DEV)
    rot.build_tables(4096)
    pos = torch.randint(0, 4096, (T,), device=DEV, generator=g)
    qkv = torch.randn(T, (H + 2 * KVH) * D, device=DEV, generator=g).bfloat16()
    q, k, v = (
        qkv[:, : H * D].view(T, H, D),
        qkv[:, H * D : (H + KVH) * D].view(T, KVH, D),
        qkv[:, (H + KVH) * D :].view(T, KVH, D),
    )
    q0, k0, v0 = q.double(), k.double(), v.double()
    rq, rk = RotaryEmbedding(D, 500000.0, None, DEV)(pos, q0, k0)  # float64 reference rotation
    slots = torch.randperm(P * ps, device=DEV, generator=g)[:T]
    slots[3] = -1  # a padded row: rotated, not written
    zeros = lambda dt: torch.zeros(P, ps, KVH, D, dtype=dt, device=DEV)  # noqa: E731
    if int8:  # (K, V, K scales, V scales, no zero points): symmetric, group 64
        ones = lambda: torch.ones(P, ps, KVH, 2, dtype=torch.float16, device=DEV)  # noqa: E731
        pool = (zeros(torch.int8), zeros(torch.int8), ones(), ones(), None, None)
    else:
        pool = (zeros(torch.bfloat16), zeros(torch.bfloat16))
    rope_kv_write(pos, q, k, v, rot.cos, rot.sin, slots, pool)
    assert rel(q, rq) < 1e-2 and rel(k, rk) < 1e-2
    ok = slots >= 0
    if int8:
        kq, vq, ks, vs = pool[:4]
        kc = Q.dequantize(kq, ks, None, 64, torch.float32)
        vc = Q.dequantize(vq, vs, None, 64, torch.float32)
        # stored exactly what the torch path stores for the same (rotated, bf16) k and v
        eq, es, _ = Q.quantize(k[ok].cpu(), 64, False)
        assert torch.equal(kq.view(-1, KVH, D)[slots[ok]].cpu(), eq) and torch.equal(
            ks.view(-1, KVH, 2)[slots[ok]].cpu(), es
        )
    else:
        kc, vc = pool
    kc, vc = kc.view(-1, KVH, D), vc.view(-1, KVH, D)
    assert rel(kc[slots[ok]], rk[ok]) < 1.5e-2 and rel(vc[slots[ok]], v0[ok]) < 1e-2
    untouched = torch.ones(P * ps, dtype=torch.bool, device=DEV)
    untouched[slots[ok]] = False
    assert (kc[untouched] == 0).all()
