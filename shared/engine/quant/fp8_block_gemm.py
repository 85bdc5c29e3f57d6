"""Triton kernel: block-scaled FP8 GEMM, out = (A * a_scale) @ (B * b_scale)^T (and its per-channel variant).

A e4m3 [M, K] with one float32 scale per token per 128 columns (a_scale [M, K/128]); B e4m3 [N, K] (row-major,
as checkpoints store it) with one float32 scale per 128x128 block (b_scale [ceil(N/128), ceil(K/128)]), or per
row per 128 columns (`scale_rows=1`, b_scale [N, ceil(K/128)]: fused projections whose parts do not fill whole
128-row blocks). Each step
of the K loop covers exactly one scale group: the tensor-core partial sum of that group is multiplied by the
row's activation scale and the column's weight-block scale before it is added to the float32 accumulator. No host
sync: capturable in CUDA graphs. Tails of M, N and K are masked.

The same kernel with PER_CHANNEL scales (a_scale [M, 1] per token, b_scale [N] per output channel) applies them
once after the K loop: `channel_gemm`, a Triton alternative to `torch._scaled_mm` with quantized activations (the
bench's comparison row; decode-sized M in Fp8Linear takes the weight-only GEMV, fp8_gemv.py). Fp8Linear runs
block-scaled layers through cuBLAS's block-scaled `torch._scaled_mm` where it can (N and K multiples of 128);
this kernel is the fallback (and the path of fused parts whose scales are per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCALE_BLOCK = 128  # rows and columns of one weight scale block; columns of one activation scale group


@triton.jit
def _block_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, KG, stride_am, stride_bn, stride_cm,
    SB: tl.constexpr, SBN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP_M * grid_n  # grouped order: GROUP_M row tiles share the B tiles they read while in L2
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % rows
    pid_n = (pid % width) // rows
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, SB)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [SB, BN] tile of B^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KG):
        k_left = K - kb * SB
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
        if PER_CHANNEL:
            acc += tl.dot(a, b)
        else:
            sa = tl.load(as_ptr + offs_m * KG + kb, mask=m_ok, other=0.0)  # [BM]: this group's token scales
            sb = tl.load(bs_ptr + (offs_n // SBN) * KG + kb, mask=n_ok, other=0.0)  # [BN]: this group's blocks
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += SB
        b_ptrs += SB
    if PER_CHANNEL:
        acc *= tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)[:, None] * tl.load(bs_ptr + offs_n, mask=n_ok)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# prefill / large-batch tiles, largest first: (BM, BN, num_warps, num_stages); `default_config` takes the first
# whose grid fills the GPU (H200: 132 SMs), so M = 128 no longer runs 32 programs of 128x128 on 132 SMs
TILES = ((128, 128, 8, 3), (64, 128, 4, 4), (64, 64, 4, 4))
# the alternatives to `TILES` bench/fp8_weights.py times at M = 128 and 2048 (details of docs/bench/fp8_weights.json)
SWEEP_CONFIGS = [
    dict(BM=bm, BN=bn, GROUP_M=8, num_warps=nw, num_stages=ns)
    for bm, bn, nw, ns in [(128, 128, 8, 4), (128, 256, 8, 3), (64, 128, 4, 3), (128, 64, 4, 4), (64, 256, 8, 3)]
]  # fmt: skip


def default_config(m: int, n: int, sms: int = 132) -> dict:
    """Tile shape by token count: decode rows take narrow N tiles (more programs over the weight), larger M the
    largest of `TILES` whose grid covers the `sms` SMs (the smallest where none does). The bench
    (bench/fp8_weights.py) times the alternatives on the device."""
    if m <= 16:
        return dict(BM=16, BN=64 if n >= 16384 else 32, GROUP_M=1, num_warps=4, num_stages=4)
    tile = next((t for t in TILES if triton.cdiv(m, t[0]) * triton.cdiv(n, t[1]) >= sms), TILES[-1])
    return dict(BM=tile[0], BN=tile[1], GROUP_M=8, num_warps=tile[2], num_stages=tile[3])


def _launch(a, a_scale, b, b_scale, out_dtype, config, per_channel: bool, scale_rows: int = 1) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 132
    cfg = dict(config or default_config(m, n, sms))
    bm, bn = cfg.pop("BM"), cfg.pop("BN")
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _block_gemm_kernel[grid](
        a, a_scale, b, b_scale, c, m, n, k, triton.cdiv(k, SCALE_BLOCK), a.stride(0), b.stride(0), c.stride(0),
        SB=SCALE_BLOCK, SBN=scale_rows, BM=bm, BN=bn, PER_CHANNEL=per_channel, **cfg,
    )  # fmt: skip
    return c


def block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
    scale_rows: int = SCALE_BLOCK,
) -> torch.Tensor:
    """a e4m3 [M, K], a_scale float32 [M, ceil(K/128)], b e4m3 [N, K], b_scale float32 [ceil(N/scale_rows),
    ceil(K/128)] -> [M, N] in `out_dtype`."""
    m, k = a.shape
    n = b.shape[0]
    kg = -(-k // SCALE_BLOCK)
    assert b.shape[1] == k and a.stride(1) == 1 and b.stride(1) == 1
    assert a_scale.shape == (m, kg) and a_scale.is_contiguous()
    assert scale_rows in (1, SCALE_BLOCK) and b_scale.shape == (-(-n // scale_rows), kg) and b_scale.is_contiguous()
    return _launch(a, a_scale, b, b_scale, out_dtype, config, per_channel=False, scale_rows=scale_rows)


def channel_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
) -> torch.Tensor:
    """a e4m3 [M, K], a_scale float32 [M, 1] (per token), b e4m3 [N, K], b_scale float32 [N] (per output
    channel) -> [M, N] in `out_dtype`."""
    m, k = a.shape
    n = b.shape[0]
    assert b.shape[1] == k and a.stride(1) == 1 and b.stride(1) == 1
    assert a_scale.shape == (m, 1) and a_scale.is_contiguous() and b_scale.shape == (n,) and b_scale.is_contiguous()
    return _launch(a, a_scale, b, b_scale, out_dtype, config, per_channel=True)
