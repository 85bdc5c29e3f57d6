"""RMSNorm with an optional fused residual add, rounding like the torch/HF module it replaces:
    residual <- (x + residual) rounded to the activation dtype   (HAS_RES)
    h = (residual in float32) * rsqrt(mean(residual^2) + eps), rounded to the activation dtype
    out = weight * h, rounded to the activation dtype
One program per row (the hidden size fits one block).

`rmsnorm_fp8`: the same, with `out` quantized to e4m3 per row in the same program (scale = amax(|out|) / 448, the
math of quant/fp8_quant.quantize_activations on the rounded `out`) for a per-channel FP8 projection that reads it:
the GEMM input is written once, in one byte a value, and never read back for a separate quantization pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FP8 = torch.float8_e4m3fn
AMAX_FLOOR = 1e-12  # = quant/fp8_quant.AMAX_FLOOR: an all-zero row gets a tiny scale instead of a division by zero


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    x_stride,
    res_ptr,
    res_stride,
    w_ptr,
    out_ptr,
    out_stride,
    scale_ptr,
    n_cols,
    eps,
    amax_floor,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: wait for the previous kernel's writes, let the next launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=m, other=0.0)
        s = (xf + r.to(tl.float32)).to(dt)
        tl.store(res_ptr + row * res_stride + cols, s, mask=m)
        xf = s.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    h = (xf * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if QUANT:  # the activation-dtype output, then e4m3 with the row's scale (masked columns are 0: no effect)
        y = (w * h).to(dt).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), amax_floor) / 448.0
        tl.store(out_ptr + row * out_stride + cols, tl.clamp(y / scale, -448.0, 448.0).to(out_ptr.dtype.element_ty),
                 mask=m)  # fmt: skip
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(out_ptr + row * out_stride + cols, (w * h).to(out_ptr.dtype.element_ty), mask=m)


def _launch(x, weight, eps, residual, out, scale, pdl: bool) -> None:
    t, n = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _rmsnorm_kernel[(t,)](
        x,
        x.stride(0),
        res,
        res.stride(0),
        weight,
        out,
        out.stride(0),
        scale if scale is not None else out,
        n,
        eps,
        AMAX_FLOOR,
        HAS_RES=residual is not None,
        QUANT=scale is not None,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=8 if block >= 4096 else 4,
        **(dict(launch_pdl=True) if pdl else {}),
    )


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pdl: bool = False
) -> torch.Tensor:
    """x [T, N] -> RMSNorm(x) [T, N]; with `residual` [T, N]: residual += x in place, returns RMSNorm(residual).
    `pdl`: programmatic dependent launch (Hopper; kernels/gemv.py says how the decode chain uses it)."""
    out = torch.empty_like(x)
    _launch(x, weight, eps, residual, out, None, pdl)
    return out


def rmsnorm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `rmsnorm`, the output quantized per row: (q [T, N] e4m3, scale [T, 1] float32), q * scale ≈ RMSNorm(x)
    rounded to x's dtype (`_scaled_mm`'s rowwise scale_a layout)."""
    t, n = x.shape
    q = torch.empty(t, n, dtype=FP8, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t:
        _launch(x, weight, eps, residual, q, scale, pdl)
    return q, scale
