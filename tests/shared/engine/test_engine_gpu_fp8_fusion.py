"""Fused per-token FP8 activation quantization on the GPU: `rmsnorm_fp8` and `silu_mul_fp8` against the unfused
kernels followed by the Triton quantizer (every byte), `Fp8Linear` on an `Fp8Activation` against its own
quantizing path, and `fast_accum` against the dequantized reference. CUDA + triton only; skipped elsewhere.

`python tests/shared/engine/test_engine_gpu_fp8_fusion.py`: one 8B layer's projections at 8192 tokens (norms,
SwiGLU and the four GEMMs; no attention), bf16 against FP8 per channel unfused / fused, fast accumulation off / on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import kernels
from pdserve.engine.quant.fp8_checkpoint import ONLINE_FP8
from pdserve.engine.quant.fp8_linear import Fp8Activation, Fp8Linear
from pdserve.engine.quant.fp8_quant import quantize_activations, quantize_weight_per_channel

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels.HAVE_TRITON, reason="needs a CUDA GPU and triton"
)
DEV = torch.device("cuda")
PROJ = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # 8B (N, K)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def mismatched(q: torch.Tensor, ref: torch.Tensor) -> float:
    return (q.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()


def channel_layer(n: int, k: int, seed: int, bias: bool = False) -> tuple[Fp8Linear, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(n, k, device=DEV, generator=g) * k**-0.5).bfloat16()
    lin = Fp8Linear(k, n, bias, ONLINE_FP8).to(DEV)
    q, s = quantize_weight_per_channel(w)
    lin.weight.copy_(q)
    lin.weight_scale.copy_(s)
    if lin.bias is not None:
        lin.bias.copy_(torch.randn(n, device=DEV, generator=g) * 0.1)
    return lin, w


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("t, n", [(17, 4096), (300, 8192), (2048, 4096), (5, 200)])
def test_rmsnorm_fp8_matches_rmsnorm_then_the_quantizer(t, n, residual):
    from pdserve.engine.kernels.rmsnorm import rmsnorm, rmsnorm_fp8

    x = (torch.randn(t, n, device=DEV) * torch.rand(t, 1, device=DEV) * 4).bfloat16()
    x[0] = 0
    w = (torch.rand(n, device=DEV) + 0.5).bfloat16()
    r = torch.randn(t, n, device=DEV).bfloat16()
    r1, r2 = (r.clone(), r.clone()) if residual else (None, None)
    q, s = rmsnorm_fp8(x, w, 1e-5, r2)
    rq, rs = quantize_activations(rmsnorm(x, w, 1e-5, r1), None)
    assert torch.equal(s, rs) and mismatched(q, rq) <= 1e-4
    assert r1 is None or torch.equal(r1, r2)


@pytest.mark.parametrize("single_pass", [False, None])
@pytest.mark.parametrize("t, i", [(17, 14336), (300, 28672), (2048, 14336), (5, 200)])
def test_silu_mul_fp8_matches_silu_mul_then_the_quantizer(t, i, single_pass):
    """Both kernels (the row loop; the default: single pass where the row fits, 28672 takes the loop)."""
    from pdserve.engine.kernels.silu_mul import silu_mul, silu_mul_fp8

    gu = (torch.randn(t, 2 * i, device=DEV) * 3).bfloat16()
    q, s = silu_mul_fp8(gu, single_pass=single_pass)
    rq, rs = quantize_activations(silu_mul(gu), None)
    assert torch.equal(s, rs) and mismatched(q, rq) <= 1e-4


@pytest.mark.parametrize("m", [17, 256, 4096])
def test_quantized_input_and_fast_accum(m):
    lin, w = channel_layer(4096, 14336, seed=m, bias=True)
    x = (torch.randn(m, 14336, device=DEV) * 2).bfloat16()
    q, s = quantize_activations(x, None)
    assert torch.equal(lin(Fp8Activation(q, s, x.dtype)), lin(x))  # the same math, quantized before the layer
    ref = lin.reference(x.float())
    fast = lin(x)
    lin.fast_accum = False
    exact = lin(x)
    assert rel(exact, ref) < 1e-2 and rel(fast, ref) < 1e-2 and rel(fast, exact) < 1e-2
    assert rel(fast, x.float() @ w.float().t() + lin.bias.float()) < 8e-2  # vs the unquantized layer


def cuda_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(m: int = 8192) -> None:
    from pdserve.engine.kernels.rmsnorm import rmsnorm, rmsnorm_fp8
    from pdserve.engine.kernels.silu_mul import silu_mul, silu_mul_fp8

    lin = {p: channel_layer(n, k, seed=i) for i, (p, (n, k)) in enumerate(PROJ.items())}
    x, a = (torch.randn(m, 4096, device=DEV).bfloat16() for _ in range(2))  # a: attention's output stand-in
    res, nw = torch.randn(m, 4096, device=DEV).bfloat16(), torch.ones(4096, device=DEV).bfloat16()

    def bf16() -> None:
        F.linear(rmsnorm(x, nw, 1e-5, res), lin["qkv"][1])
        o = F.linear(a, lin["o"][1])
        gu = F.linear(rmsnorm(o, nw, 1e-5, res), lin["gate_up"][1])
        F.linear(silu_mul(gu), lin["down"][1])

    def fp8(fused: bool) -> None:
        L = {p: v[0] for p, v in lin.items()}
        if fused:
            L["qkv"](Fp8Activation(*rmsnorm_fp8(x, nw, 1e-5, res), x.dtype))
            o = L["o"](a)
            gu = L["gate_up"](Fp8Activation(*rmsnorm_fp8(o, nw, 1e-5, res), x.dtype))
            L["down"](Fp8Activation(*silu_mul_fp8(gu), x.dtype))
        else:
            L["qkv"](rmsnorm(x, nw, 1e-5, res))
            o = L["o"](a)
            gu = L["gate_up"](rmsnorm(o, nw, 1e-5, res))
            L["down"](silu_mul(gu))

    gu = torch.randn(m, 2 * 14336, device=DEV).bfloat16()
    unfused = cuda_ms(lambda: quantize_activations(silu_mul(gu), None))
    loop, single = (cuda_ms(lambda sp=sp: silu_mul_fp8(gu, single_pass=sp)) for sp in (False, True))
    print(
        f"M={m} SwiGLU -> e4m3 (I = 14336): silu_mul + quantizer {unfused:.3f} ms, fused row loop {loop:.3f} ms, "
        f"fused single pass {single:.3f} ms (gate_up read once: {gu.numel() * 2 / single / 1e9:.2f} TB/s)"
    )
    unfused = cuda_ms(lambda: quantize_activations(rmsnorm(x, nw, 1e-5, res), None))
    fused = cuda_ms(lambda: rmsnorm_fp8(x, nw, 1e-5, res))
    print(f"M={m} RMSNorm -> e4m3 (4096, residual): rmsnorm + quantizer {unfused:.3f} ms, fused {fused:.3f} ms")
    flops = 2 * m * sum(n * k for n, k in PROJ.values())
    base = cuda_ms(bf16)
    print(f"M={m}: bf16 {base:.3f} ms ({flops / base / 1e9:.0f} TFLOP/s)")
    for fast in (False, True):
        for p in lin:
            lin[p][0].fast_accum = fast
        for fused in (False, True):
            ms = cuda_ms(lambda f=fused: fp8(f))
            print(f"  fp8 fast_accum={fast!s:5} fused={fused!s:5} {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), "
                  f"{base / ms:.2f}x bf16")  # fmt: skip


if __name__ == "__main__":
    main()
