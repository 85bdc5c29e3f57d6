"""Decode attention over the fp8 (e4m3fn) paged KV pool, read directly (split-K "flash decoding", as
`int8_decode_attention`, whose split, page-walk, online-softmax and combine helpers it shares).

The pool holds one fp16 scale per (token, KV head) (`pdserve.kv.quant`, group = head_dim), so the scales fold
out of the tiles: a K or V tile is converted fp8 -> q's dtype exactly (every e4m3 value is a bf16 / fp16 value;
no multiply), QK^T is scaled per key on the [QP, BLOCK] scores and P per value before the PV dot. It moves
1 byte per K/V element + 2 bytes per (token, head) of scales.

Why not FA3's FP8 path: FA3 (flash_attn_interface) takes fp8 q, k and v with one descale per (sequence, KV head);
our scales are per token (appended pages never rescale), and an fp8 q would add its own rounding.

Graph-safe: the grid depends only on the batch size and `num_splits` (as the int8 kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.paged_decode_common import (
    _combine_kernel,
    _online_softmax,
    _pool_rows,
    _split_range,
    _store_split_stats,
)

# One warp per program, 32-key blocks, 3 stages, as the int8 lean loop: the probabilities stay in the warp's registers
# (no hand-off between warps, no barrier in the loop). The kernel is bound by the e4m3 conversion either way; at
# batch 128 this launch is the faster one, at batch 64 the two are even.
FP8_CONFIG = dict(block_n=32, num_warps=1, num_stages=3, split_mult=2)


@triton.jit
def _fp8_decode_kernel(
    q_ptr,
    q_sb,
    q_sh,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    table_ptr,
    table_stride,
    seqlens_ptr,
    po_ptr,
    pml_ptr,
    out_ptr,
    out_sb,
    out_sh,
    qk_scale,
    num_splits,
    KVH: tl.constexpr,
    QPK: tl.constexpr,
    QP: tl.constexpr,
    PS: tl.constexpr,
    D: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    start, end = _split_range(seqlens_ptr, b, sp, num_splits, BLOCK, USE_PDL)

    qi = tl.arange(0, QP)
    qmask = qi < QPK
    d = tl.arange(0, D)
    heads = kh * QPK + qi
    q = tl.load(
        q_ptr + b.to(tl.int64) * q_sb + heads[:, None] * q_sh + d[None, :], mask=qmask[:, None], other=0.0
    )  # [QP, D]
    dt = q.dtype
    m = tl.full([QP], float("-inf"), tl.float32)
    l = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, D], tl.float32)
    tab = table_ptr + b.to(tl.int64) * table_stride
    for n0 in range(start, end, BLOCK):
        row, ok = _pool_rows(tab, n0, end, kh, KVH, PS, BLOCK)  # [BLOCK] pool rows
        kv_off = row[:, None] * D + d[None, :]  # [BLOCK, D]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0).to(dt)  # exact: e4m3 is a subset of bf16/fp16
        ks = tl.load(ks_ptr + row, mask=ok, other=0.0).to(tl.float32)  # [BLOCK] one scale per key
        qk = tl.dot(q, tl.trans(k)) * ks[None, :]
        qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))  # [QP, BLOCK] (log2 units)
        p, alpha, m, l = _online_softmax(qk, m, l)
        v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0).to(dt)
        vs = tl.load(vs_ptr + row, mask=ok, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(dt), v)
    if DIRECT:
        o = acc / l[:, None]
        tl.store(
            out_ptr + b.to(tl.int64) * out_sb + heads[:, None] * out_sh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=qmask[:, None],
        )
    else:
        part = _store_split_stats(pml_ptr, b, heads, sp, num_splits, KVH * QPK, m, l, qmask)  # [QP]
        tl.store(po_ptr + part[:, None] * D + d[None, :], acc, mask=qmask[:, None])


def fp8_paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scales: torch.Tensor,
    v_scales: torch.Tensor,
    page_table: torch.Tensor,
    seqlens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int = FP8_CONFIG["block_n"],
    num_warps: int = FP8_CONFIG["num_warps"],
    num_stages: int = FP8_CONFIG["num_stages"],
    pdl: bool = False,
) -> torch.Tensor:
    """q [B, HQ, D] (bf16 / fp16) -> out [B, HQ, D] (q's dtype). k/v [P, ps, KVH, D] float8_e4m3fn (one layer),
    k_scales / v_scales [P, ps, KVH, 1] fp16 (one per token and KV head), page_table [B, W] int32, seqlens [B] int32
    (>= 1: keys 0..seqlens-1 are attended). `pdl`: programmatic dependent launch (Hopper)."""
    b, hq, d = q.shape
    _, ps, kvh, _ = k.shape
    assert k.dtype == v.dtype == torch.float8_e4m3fn, f"fp8 pool expected, got {k.dtype}"
    assert k_scales.shape[-1] == 1 and v_scales.shape[-1] == 1, "fp8 decode needs one scale per (token, KV head)"
    assert q.stride(-1) == 1 and k.is_contiguous() and v.is_contiguous()
    assert k_scales.is_contiguous() and v_scales.is_contiguous()
    qpk = hq // kvh
    qp = max(16, triton.next_power_of_2(qpk))
    if out is None:
        out = torch.empty_like(q)
    direct = num_splits == 1
    if direct:
        po = pml = out  # unused
    else:
        po = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
        pml = torch.empty(b, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    launch = dict(launch_pdl=True) if pdl else {}
    _fp8_decode_kernel[(b, kvh, num_splits)](
        q,
        q.stride(0),
        q.stride(1),
        k,
        v,
        k_scales,
        v_scales,
        page_table,
        page_table.stride(0),
        seqlens,
        po,
        pml,
        out,
        out.stride(0),
        out.stride(1),
        scale * 1.4426950408889634,
        num_splits,
        KVH=kvh,
        QPK=qpk,
        QP=qp,
        PS=ps,
        D=d,
        DIRECT=direct,
        BLOCK=block_n,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch,
    )
    if not direct:
        _combine_kernel[(b, hq)](
            po,
            pml,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            HQ=hq,
            D=d,
            SP=triton.next_power_of_2(num_splits),
            USE_PDL=pdl,
            **launch,
        )
    return out
