"""y = x @ W^T (+ b) for a handful of rows (decode at batch <= MAX_M): a bandwidth-bound matrix-vector kernel.
Each program owns BLOCK_N output columns and streams their weight rows once, in [BLOCK_N, BLOCK_K] tiles, with
fp32 accumulation; no split-K, so no second reduction kernel (cuBLAS splits K for some decode shapes and adds
one). Which is faster depends on the projection's shape, so the model uses it only where the GEMV plan
(`EngineConfig.gemv_plan`, held by `KernelChoice.gemv`) names a config.

Two fusions for the decode step:
- `act="silu_mul"`: x is the gate_up projection's output [M, 2K] (gate | up) and the kernel applies SwiGLU while
  loading it, rounding exactly like kernels/silu_mul.py (so the separate activation kernel disappears).
- `pdl=True` (Hopper, programmatic dependent launch): the kernel is launched while the previous kernel still
  runs; each program loads its first weight tile (weights are never written by an earlier kernel), then waits
  for the previous kernel (`gdc_wait`) before it reads x, and lets the next kernel launch. This hides launch
  latency and the ramp-up of the weight stream behind the previous kernel's tail."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MAX_M = 4
DEFAULT_CONFIG = dict(block_n=16, block_k=1024, num_warps=4, num_stages=2)
# The decode plan of the 8B shape: per projection a Triton config, or None for cuBLAS. `down` (K = 14336) stays on
# cuBLAS (+ the SwiGLU kernel): its long K suits split-K, which the Triton GEMV does not do. The choice is by whole
# b1 step time inside the PDL chain, not by each kernel alone, since cuBLAS kernels do not overlap their launch.
DEFAULT_PLAN = {
    "qkv": dict(DEFAULT_CONFIG),
    "o": dict(block_n=8, block_k=2048, num_warps=4, num_stages=2),
    "gate_up": dict(block_n=8, block_k=2048, num_warps=4, num_stages=2),
    "down": None,
}
ACTIVATIONS = (None, "silu_mul")


@triton.jit
def _x_tile(x_ptr, m, M, k, K, x_stride, SILU_MUL: tl.constexpr):
    """Rows m [BLOCK_M] x columns k [BLOCK_K] of the input, in the activation dtype."""
    mask = (m[:, None] < M) & (k[None, :] < K)
    x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=mask, other=0.0)
    if SILU_MUL:  # x = gate; up sits K columns further; silu rounded, then the product (as silu_mul.py)
        u = tl.load(x_ptr + m[:, None] * x_stride + K + k[None, :], mask=mask, other=0.0)
        gf = x.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf))).to(x.dtype).to(tl.float32)
        x = (a * u.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    y_stride,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    nmask = n < N
    wrow = w_ptr + n[:, None].to(tl.int64) * w_stride  # [BLOCK_N, 1]
    k = tl.arange(0, BLOCK_K)
    w = tl.load(wrow + k[None, :], mask=nmask[:, None] & (k[None, :] < K), other=0.0)  # [BLOCK_N, BLOCK_K]
    if USE_PDL:  # the first weight tile is in flight; now wait for the kernel that wrote x
        gdc_wait()
        gdc_launch_dependents()
    x = _x_tile(x_ptr, m, M, k, K, x_stride, SILU_MUL)  # [BLOCK_M, BLOCK_K]
    acc = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(wrow + k[None, :], mask=nmask[:, None] & (k[None, :] < K), other=0.0)
        x = _x_tile(x_ptr, m, M, k, K, x_stride, SILU_MUL)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + m[:, None] * y_stride + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(m[:, None] < M) & nmask[None, :],
    )


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    act: str | None = None,
    pdl: bool = False,
    block_n: int = DEFAULT_CONFIG["block_n"],
    block_k: int = DEFAULT_CONFIG["block_k"],
    num_warps: int = DEFAULT_CONFIG["num_warps"],
    num_stages: int = DEFAULT_CONFIG["num_stages"],
) -> torch.Tensor:
    """x [M, K] (M <= MAX_M; [M, 2K] gate|up with act="silu_mul"), w [N, K], b [N] | None -> [M, N] in x's
    dtype. `pdl`: launch as a programmatic dependent launch (Hopper; see the module docstring)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    m = x.shape[0]
    n, k = w.shape
    assert m <= MAX_M and x.stride(1) == 1 and w.stride(1) == 1
    assert x.shape[1] == (2 * k if act else k), (x.shape, w.shape, act)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    extra = dict(launch_pdl=True) if pdl else {}
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        b if b is not None else w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        HAS_BIAS=b is not None,
        SILU_MUL=act == "silu_mul",
        USE_PDL=pdl,
        BLOCK_M=triton.next_power_of_2(max(m, 1)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **extra,
    )
    return y
