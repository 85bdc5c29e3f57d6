"""y = x @ W^T (+ b) for a handful of rows (decode at batch <= MAX_M): a bandwidth-bound matrix-vector kernel.
Each program owns BLOCK_N output columns and streams their weight rows once, in [BLOCK_N, BLOCK_K] tiles, with
fp32 accumulation; no split-K, so no second reduction kernel (cuBLAS splits K for some decode shapes and adds
one). bench/gpu_engine.py times it against cuBLAS per layer shape and picks; the model uses it only when
`CausalLM.small_m_gemv` is set."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 4
DEFAULT_CONFIG = dict(block_n=16, block_k=1024, num_warps=4, num_stages=2)  # bench/gpu_engine.py sweep winner


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, x_stride, w_stride, y_stride, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    nmask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * w_stride + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)                                                         # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=(m[:, None] < M) & kmask[None, :],
                    other=0.0)                                                         # [BLOCK_M, BLOCK_K]
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * y_stride + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & nmask[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, block_n: int = DEFAULT_CONFIG["block_n"],
         block_k: int = DEFAULT_CONFIG["block_k"], num_warps: int = DEFAULT_CONFIG["num_warps"],
         num_stages: int = DEFAULT_CONFIG["num_stages"]) -> torch.Tensor:
    """x [M, K] (M <= MAX_M), w [N, K], b [N] | None -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_M and x.stride(1) == 1 and w.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, b if b is not None else w, y, m, n, k, x.stride(0), w.stride(0),
                                             y.stride(0), HAS_BIAS=b is not None,
                                             BLOCK_M=triton.next_power_of_2(max(m, 1)), BLOCK_N=block_n,
                                             BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return y
