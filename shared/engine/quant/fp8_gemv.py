"""Triton kernel: y = x @ (W * scale)^T (+ b) over e4m3 weights for decode-sized batches (M <= MAX_M tokens).

Weight-only dequantization: the activations stay in their dtype (bf16 in the engine; no activation quantization
and no quantizer launch), each weight tile is loaded as e4m3 (16 bytes per thread), converted exactly to the
activation dtype in registers and multiplied on the tensor cores with an fp32 accumulator. At M <= 16 the work is
reading the weight bytes, so the kernel spreads them over many programs: split-K, each program owning BLOCK_N
output channels and one contiguous run of 128-column groups, `SPLIT` programs along K writing fp32 partial sums
that a second small kernel adds up (in a fixed order: deterministic), with the bias and the cast to the output
dtype (no split, where the output channels alone give enough programs: one launch, the first kernel writes y).
Scales:
- per channel (scale [N]): applied once to each program's partial sum;
- per 128x128 block (scale [ceil(N/128), ceil(K/128)]) or per row per 128 columns (`scale_rows=1`): each K step is
  one 128-column group, whose partial product is multiplied by its [BLOCK_N] scales before it joins the sum.
No host sync (the split is chosen from shapes and the SM count): capturable in the decode CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 16  # rows one program multiplies (the tensor-core tile's M); Fp8Linear routes larger batches elsewhere
GROUP = 128  # columns of one K step: one block-scale group
K_STEP = tl.constexpr(GROUP)  # the same, as kernels read globals
DEFAULT_CONFIG = dict(block_n=64, num_warps=4, num_stages=4, programs_per_sm=4)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, KG, groups_per_split, x_stride, w_stride,
    SBN: tl.constexpr, PER_CHANNEL: tl.constexpr, FP32: tl.constexpr, DIRECT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    kk = tl.arange(0, K_STEP)
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * w_stride  # [BLOCK_N, 1]
    x_rows = x_ptr + m[:, None] * x_stride  # [BLOCK_M, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g0 = pid_k * groups_per_split
    for g in range(g0, tl.minimum(g0 + groups_per_split, KG)):
        k = g * K_STEP + kk
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, GROUP] e4m3
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, GROUP]
        if FP32:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))  # e4m3 -> bf16/fp16 is exact
        if PER_CHANNEL:
            acc += part
        else:
            acc += part * tl.load(s_ptr + (n // SBN) * KG + g, mask=n_ok, other=0.0)[None, :]
    if PER_CHANNEL:
        acc *= tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
    out = out_ptr + pid_k * M * N + m[:, None] * N + n[None, :]  # y [M, N], or partials [SPLIT, M, N] fp32
    if DIRECT:  # no split: this program holds the whole sum
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, y_ptr, MN, N, SPLIT, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, SPLIT):
        acc += tl.load(part_ptr + s * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def split_k(n: int, k: int, block_n: int, programs: int) -> int:
    """Programs along K: enough that the grid has about `programs` programs (1 where the output channels give at
    least half of them: the second kernel costs more than the missing parallelism), at most one per group."""
    tiles = triton.cdiv(n, block_n)
    if 2 * tiles >= programs:
        return 1
    return max(1, min(triton.cdiv(k, GROUP), round(programs / tiles)))


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_rows: int = 0,
    out_dtype: torch.dtype | None = None,
    block_n: int = DEFAULT_CONFIG["block_n"],
    num_warps: int = DEFAULT_CONFIG["num_warps"],
    num_stages: int = DEFAULT_CONFIG["num_stages"],
    programs_per_sm: int = DEFAULT_CONFIG["programs_per_sm"],
    split: int = 0,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_M; bf16, fp16 or fp32), w e4m3 [N, K], scale float32: [N] per channel (scale_rows=0),
    else [ceil(N/scale_rows), ceil(K/128)] (scale_rows 128: 128x128 blocks, 1: per row per 128 columns); bias [N]
    | None -> [M, N] in `out_dtype` (default x's dtype). `split`: programs along K (0: from the SM count)."""
    m, k = x.shape
    n = w.shape[0]
    kg = triton.cdiv(k, GROUP)
    assert m <= MAX_M and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1 and scale.is_contiguous()
    if scale_rows:
        assert scale.shape == (triton.cdiv(n, scale_rows), kg), (scale.shape, n, k, scale_rows)
    else:
        assert scale.shape == (n,), (scale.shape, n)
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    if not split:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        split = split_k(n, k, block_n, programs_per_sm * sms)
    per_split = triton.cdiv(kg, split)
    split = triton.cdiv(kg, per_split)  # no program without a group
    part = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, w, scale, bias if bias is not None else scale, part, m, n, k, kg, per_split, x.stride(0), w.stride(0),
        SBN=max(scale_rows, 1), PER_CHANNEL=not scale_rows, FP32=x.dtype == torch.float32, DIRECT=split == 1,
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split == 1:
        return y
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](
        part, bias if bias is not None else scale, y, m * n, n, split, HAS_BIAS=bias is not None, BLOCK=block
    )
    return y
