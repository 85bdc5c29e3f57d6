"""y = x @ W^T (+ b) whose every row depends only on that row of x: the GEMM of `--batch-invariant` on CUDA.

cuBLAS picks its kernel (tile, split-K, stream-K) by the shapes, so a row's summation order, and so its last bits,
change with how many rows share the call (batch mates, the chunk a prompt row lands in). With quantized KV those
bits become whole rounding steps and then other tokens. This kernel has one compiled configuration for every M
(`M` is not specialised): each program computes a [BLOCK_M, BLOCK_N] tile over the whole K in BLOCK_K steps, in
the same order for every row of every tile, fp32 accumulation, no split-K. Rows never mix, so a row's result is
the same bits alone, in a batch of 200, or inside a 2048-row prefill chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONFIG = dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    w_stride,
    out_stride,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)  # N tiles vary fastest: programs in flight share the same x rows
    pid_m = tl.program_id(1)
    m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None] * w_stride + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        if IEEE:  # fp32 weights: full-precision products (F.linear's default on CUDA: no TF32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + m[:, None] * out_stride + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(m[:, None] < M) & (n[None, :] < N),
    )


def invariant_matmul(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ b [N]) -> [M, N] in x's dtype; row i of the result depends on x[i] alone."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    c = CONFIG
    grid = (triton.cdiv(n, c["block_n"]), triton.cdiv(m, c["block_m"]))
    _matmul_kernel[grid](
        x,
        w,
        w if b is None else b,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        HAS_BIAS=b is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=c["block_m"],
        BLOCK_N=c["block_n"],
        BLOCK_K=c["block_k"],
        num_warps=c["num_warps"],
        num_stages=c["num_stages"],
    )
    return out
