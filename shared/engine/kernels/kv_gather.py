"""Dequantize the quantized (int8 or fp8) KV pages of a batch into a dense scratch laid out page-contiguously per
sequence, so that FlashAttention-3's paged kernel can read it (int8 prefill chunks; the "dequant" int8 decode path).

Pool layer views (see kv_cache.py): data [2, P, ps, H, D] int8, scales/zeros [2, P, ps, H, G] fp16 (index 0 = K,
1 = V). Output [2, B, W * ps, H, D]: sequence b's token t at [:, b, t]. Tokens in [seqlens[b], seqlens[b] + PAD)
are written as zeros: attention kernels load whole tiles and mask the scores, but 0 * NaN from an unwritten
(garbage) V row would still poison the output. Tokens past that are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.kv_quant import dequantize_tile

BLOCK_T = 16  # tokens per program
PAD = 256  # zeroed tokens after each sequence (>= any FA3 key tile)


@triton.jit
def _dequant_pages_kernel(
    data_ptr,
    s_ptr,
    z_ptr,
    data_kv_stride,
    s_kv_stride,
    table_ptr,
    table_stride,
    seqlens_ptr,
    out_ptr,
    out_kv_stride,
    W_TOKENS,
    H: tl.constexpr,
    PS: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    ASYM: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
):
    b = tl.program_id(0)
    tb = tl.program_id(1)
    kv = tl.program_id(2).to(tl.int64)
    n = tl.load(seqlens_ptr + b)
    n_pad = tl.minimum(n + PAD, W_TOKENS)
    if tb * BLOCK < n_pad:
        r = tl.arange(0, BLOCK * H)
        t = tb * BLOCK + r // H
        h = r % H
        ok = t < n
        ok_store = t < n_pad
        page = tl.load(table_ptr + b.to(tl.int64) * table_stride + t // PS, mask=ok, other=0).to(tl.int64)
        src = (page * PS + t % PS) * H + h
        dst = (b.to(tl.int64) * W_TOKENS + t) * H + h
        d = tl.arange(0, D)
        gi = tl.arange(0, G)
        q = tl.load(data_ptr + kv * data_kv_stride + src[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        s = tl.load(s_ptr + kv * s_kv_stride + src[:, None] * G + gi[None, :], mask=ok[:, None], other=1.0)
        z = s
        if ASYM:
            z = tl.load(z_ptr + kv * s_kv_stride + src[:, None] * G + gi[None, :], mask=ok[:, None], other=0.0)
        x = tl.where(ok[:, None], dequantize_tile(q, s, z, G, D // G, ASYM), 0.0)
        tl.store(
            out_ptr + kv * out_kv_stride + dst[:, None] * D + d[None, :],
            x.to(out_ptr.dtype.element_ty),
            mask=ok_store[:, None],
        )


def dequant_pages(
    data: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    page_table: torch.Tensor,
    seqlens: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """data [2, P, ps, H, D] int8 | float8_e4m3fn (one layer), page_table [B, W] int32, seqlens [B] int32
    -> out [2, B, W * ps, H, D] of `dtype` (valid up to seqlens[b], then PAD zeros). Graph-safe: the grid
    depends on B and W."""
    _, _, ps, h, d = data.shape
    g = scales.shape[-1]
    b, w = page_table.shape
    assert data.stride(-1) == 1 and data[0].is_contiguous() and scales[0].is_contiguous()
    if out is None:
        out = torch.empty(2, b, w * ps, h, d, dtype=dtype, device=data.device)
    grid = (b, triton.cdiv(w * ps, BLOCK_T), 2)
    _dequant_pages_kernel[grid](
        data,
        scales,
        zeros if zeros is not None else scales,
        data.stride(0),
        scales.stride(0),
        page_table,
        page_table.stride(0),
        seqlens,
        out,
        out.stride(0),
        w * ps,
        H=h,
        PS=ps,
        D=d,
        G=g,
        ASYM=zeros is not None,
        BLOCK=BLOCK_T,
        PAD=PAD,
    )
    return out
