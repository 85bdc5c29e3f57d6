"""Per-token FP8 activation quantization fused into its producers (kernels/rmsnorm.py `rmsnorm_fp8`, kernels/
silu_mul.py `silu_mul_fp8`) in Triton's interpreter against the unfused kernels followed by the torch quantizer, and
`Fp8Linear` taking a quantized input (`Fp8Activation`): which layers take one, and the CPU reference's math."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.quant.fp8_checkpoint import ONLINE_FP8, Fp8Scheme
from pdserve.engine.quant.fp8_linear import GEMV_MAX_ROWS, Fp8Activation, Fp8Linear
from pdserve.engine.quant.fp8_quant import quantize_activations_torch, quantize_weight_per_channel

INTERPRET_SCRIPT = r"""
import torch
from pdserve.engine.kernels import silu_mul as S
from pdserve.engine.kernels.rmsnorm import rmsnorm, rmsnorm_fp8
from pdserve.engine.quant.fp8_quant import quantize_activations_torch

def same_codes(q, ref):
    # the interpreter's float32 -> e4m3 cast (triton 3.6) drops a rounding carry into the next binade (7.92 -> 4.0,
    # not 8.0) and does not round every tie or subnormal to nearest even (a neighbouring code); any other
    # difference is the kernel's
    a, b = q.float(), ref.float()
    carry = (a * 2 == b) & (torch.frexp(b.abs())[0] == 0.5)
    neighbour = (q.view(torch.uint8).int() - ref.view(torch.uint8).int()).abs() == 1
    ok = (a == b) | carry | neighbour
    assert ok.all(), list(zip(a[~ok][:8].tolist(), b[~ok][:8].tolist()))
    assert (a == b).float().mean() > 0.9
torch.manual_seed(0)
S.FP8_BLOCK = 128  # several blocks a row: the two-pass loop and a partial last block
for dt in (torch.float16, torch.float32):  # fp16 stands in for bf16 (numpy, under the interpreter, has no bf16)
    for t, n, res in [(5, 96, True), (3, 200, True), (4, 64, False)]:
        x = (torch.randn(t, n) * 3).to(dt)
        x[1] = 0  # an all-zero row: the floor scale
        r, w = torch.randn(t, n).to(dt), (torch.rand(n) + 0.5).to(dt)
        r1, r2 = (r.clone(), r.clone()) if res else (None, None)
        ref = rmsnorm(x, w, 1e-5, r1)
        q, s = rmsnorm_fp8(x, w, 1e-5, r2)
        rq, rs = quantize_activations_torch(ref, None)
        assert q.dtype == torch.float8_e4m3fn and s.shape == (t, 1) and torch.equal(s, rs), (s, rs)
        assert not res or torch.equal(r1, r2)  # the residual stream updated as by the unfused kernel
        same_codes(q, rq)
        print("rmsnorm", dt, t, n)
    for t, i in [(4, 300), (2, 64), (3, 128)]:
        gu = (torch.randn(t, 2 * i) * 2).to(dt)
        ref = S.silu_mul(gu)
        q, s = S.silu_mul_fp8(gu, programs=2)  # programs loop over rows (0, 2, ...), (1, 3, ...)
        rq, rs = quantize_activations_torch(ref, None)
        assert q.shape == (t, i) and torch.equal(s, rs), (s, rs)
        same_codes(q, rq)
        q1, s1 = S.silu_mul_fp8(gu)  # the default at these widths: one program a row, one pass
        assert torch.equal(s1, s) and torch.equal(q1.view(torch.uint8), q.view(torch.uint8))
        print("silu_mul", dt, t, i)
"""


def test_fused_quantizers_in_the_triton_interpreter():
    """RMSNorm (with and without the residual add) and SwiGLU writing e4m3 + one scale per row: the scales and the
    residual stream equal the unfused kernels' followed by the torch quantizer, the codes too (but where the
    interpreter's own e4m3 cast is known wrong; the GPU test compares every byte)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", INTERPRET_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert len(r.stdout.splitlines()) == 12


def channel_layer(n: int, k: int, bias: bool = True) -> tuple[Fp8Linear, torch.Tensor]:
    w = torch.randn(n, k) * k**-0.5
    lin = Fp8Linear(k, n, bias, ONLINE_FP8)
    lin.weight, lin.weight_scale = quantize_weight_per_channel(w)
    if lin.bias is not None:
        lin.bias = torch.randn(n) * 0.1
    return lin, w


def test_which_layers_take_quantized_inputs():
    lin, _ = channel_layer(8, 16)
    assert lin.fused_input  # on by default (faster on the H200)
    assert lin.takes_fp8(GEMV_MAX_ROWS + 1) and not lin.takes_fp8(GEMV_MAX_ROWS)  # the GEMV reads bf16 rows
    lin.gemv_max_rows = 0
    assert lin.takes_fp8(1)
    lin.triton = False  # torch-ops quantization: the producers' kernels are Triton
    assert not lin.takes_fp8(100)
    block = Fp8Linear(128, 128, False, Fp8Scheme(weights="block", block_size=(128, 128), source="fp8"))
    assert not block.takes_fp8(100)  # per-128-column activation groups
    static = Fp8Linear(16, 8, False, Fp8Scheme(weights="channel", activations="static", source="compressed-tensors"))
    assert not static.takes_fp8(100)  # the checkpoint's own input scale


def test_reference_of_a_quantized_input_is_the_quantized_math():
    lin, _ = channel_layer(24, 40)
    x = torch.randn(7, 40) * 2
    q, s = quantize_activations_torch(x, None)
    out = lin.reference(Fp8Activation(q, s, torch.float32))
    assert torch.equal(out, lin.reference(x))  # the same per-token quantization, done before the layer
    assert torch.equal(lin(Fp8Activation(q, s, torch.float32)), out)  # CPU forward: the reference
    half = lin.reference(Fp8Activation(q, s, torch.float16))
    assert half.dtype == torch.float16 and torch.equal(half, out.half())
