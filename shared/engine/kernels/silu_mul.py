"""SwiGLU activation: gate_up [T, 2I] (gate | up, as the fused gate_up projection writes it) -> silu(gate) * up
[T, I], rounding like `F.silu(gate) * up` in the activation dtype (silu rounded, then the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, x_stride, out_ptr, out_stride, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: wait for the previous kernel's writes, let the next launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    g = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (a * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    t, n2 = gate_up.shape
    n = n2 // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(t, triton.cdiv(n, BLOCK))](
        gate_up,
        gate_up.stride(0),
        out,
        out.stride(0),
        n,
        BLOCK=BLOCK,
        USE_PDL=pdl,
        num_warps=4,
        **(dict(launch_pdl=True) if pdl else {}),
    )
    return out
