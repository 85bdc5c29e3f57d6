"""RMSNorm with an optional fused residual add, rounding like the torch/HF module it replaces:
    residual <- (x + residual) rounded to the activation dtype   (HAS_RES)
    h = (residual in float32) * rsqrt(mean(residual^2) + eps), rounded to the activation dtype
    out = weight * h, rounded to the activation dtype
One program per row (the hidden size fits one block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    x_stride,
    res_ptr,
    res_stride,
    w_ptr,
    out_ptr,
    out_stride,
    n_cols,
    eps,
    HAS_RES: tl.constexpr,
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
    tl.store(out_ptr + row * out_stride + cols, (w * h).to(out_ptr.dtype.element_ty), mask=m)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, pdl: bool = False
) -> torch.Tensor:
    """x [T, N] -> RMSNorm(x) [T, N]; with `residual` [T, N]: residual += x in place, returns RMSNorm(residual).
    `pdl`: programmatic dependent launch (Hopper; kernels/gemv.py says how the decode chain uses it)."""
    t, n = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty_like(x)
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
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=8 if block >= 4096 else 4,
        **(dict(launch_pdl=True) if pdl else {}),
    )
    return out
