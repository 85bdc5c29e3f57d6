"""Decode attention that reads the int8 paged KV pool directly and dequantizes in registers (split-K "flash
decoding"): one program per (sequence, KV head, split) walks its share of the sequence's pages, keeps an online
softmax for the KV head's group of query heads (padded to 16 rows for tensor-core dots), and a second kernel
merges the splits. Nothing is dequantized to memory: it moves 1 byte per K/V element (+ the fp16 scales) where
dequantize-then-FA3 moves 1 + 2 + 2. The same launcher reads a dense (bf16/fp16) pool when given no scales.

`int8_paged_decode` picks one of three kernels by the pool's shape alone (attention.py's `FA3Backend` calls it for
int8 pools with `int8_decode_kernel` "triton", for dense pools with `dense_decode_kernel` "triton", and for every
row under `batch_invariant` on CUDA):
- the lean loop (int8_planes_decode.py), the default for symmetric pools with two scale groups per head and
  head_dim >= 128 (head_dim 128 at the default group size 64), launched with `DEFAULT_CONFIG`;
- the fold2 kernel (int8_fold2_decode.py) for other symmetric two-group pools (head_dim a multiple of 8 below 128);
- the tile kernel below for every other pool: asymmetric, one or more than two groups per head, dense.
`attention.int8_launch_config` gives the fold2 and tile kernels `TILE_LAUNCH`'s block / warps / stages (the
one-warp launch suits the lean loop's narrow dots only); `decode_kernel_config` overrides block_n / num_warps /
num_stages / split_mult of any of them. What all decode kernels share (page walk, softmax step, split merge) is in
paged_decode_common.py.

Graph-safe: the grid depends only on the batch size and `num_splits`; each split's token range is computed
on the device from `seqlens` (a split past the end of a short sequence does nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.int8_fold2_decode import _decode_kernel_fold2
from pdserve.engine.kernels.int8_planes_decode import _planes_decode_kernel
from pdserve.engine.kernels.kv_quant import dequantize_tile
from pdserve.engine.kernels.paged_decode_common import (
    _combine_kernel,
    _online_softmax,
    _pool_rows,
    _split_range,
    _store_split_stats,
    default_num_splits,
)

__all__ = ["DEFAULT_CONFIG", "DENSE_CONFIG", "TILE_LAUNCH", "default_num_splits", "int8_paged_decode", "reads_planes"]

# The lean loop's launch: one warp per program (its dots are [16, D/8] wide: more warps would compute the same small
# tiles again), 32-key blocks, 3 stages; split_mult 5 is about one wave of resident programs (batch 64: 2 splits,
# batch 128: one).
DEFAULT_CONFIG = dict(block_n=32, num_warps=1, num_stages=3, split_mult=5)
# The launch shape for int8 pools the lean loop does not read (`attention.int8_launch_config` picks).
TILE_LAUNCH = dict(block_n=128, num_warps=4, num_stages=3)
DENSE_CONFIG = dict(block_n=64, num_warps=4, num_stages=3, split_mult=2)


def reads_planes(head_dim: int, groups: int, asymmetric: bool) -> bool:
    """Whether the lean loop reads a pool of this shape (else fold2 or the tile kernel)."""
    return not asymmetric and groups == 2 and head_dim >= 128 and head_dim % 8 == 0


@triton.jit
def _load_dequant(
    q_ptr,
    s_ptr,
    z_ptr,
    row,
    d,
    gi,
    ok,
    dtype,
    G: tl.constexpr,
    D: tl.constexpr,
    ASYM: tl.constexpr,
    DENSE: tl.constexpr,
):
    """Rows `row` [BLOCK] of one head: [BLOCK, D] in `dtype` (int8 pages dequantized in registers)."""
    x = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0)
    if DENSE:
        return x.to(dtype)
    s = tl.load(s_ptr + row[:, None] * G + gi[None, :], mask=ok[:, None], other=0.0)
    z = s
    if ASYM:
        z = tl.load(z_ptr + row[:, None] * G + gi[None, :], mask=ok[:, None], other=0.0)
    return dequantize_tile(x, s, z, G, D // G, ASYM).to(dtype)


@triton.jit
def _decode_kernel(
    q_ptr,
    q_sb,
    q_sh,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    kz_ptr,
    vz_ptr,
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
    G: tl.constexpr,
    ASYM: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK: tl.constexpr,
    DENSE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    start, end = _split_range(seqlens_ptr, b, sp, num_splits, BLOCK, USE_PDL)

    qi = tl.arange(0, QP)
    qmask = qi < QPK
    d = tl.arange(0, D)
    gi = tl.arange(0, G)
    heads = kh * QPK + qi
    q = tl.load(
        q_ptr + b.to(tl.int64) * q_sb + heads[:, None] * q_sh + d[None, :], mask=qmask[:, None], other=0.0
    )  # [QP, D]
    m = tl.full([QP], float("-inf"), tl.float32)
    l = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, D], tl.float32)
    tab = table_ptr + b.to(tl.int64) * table_stride
    for n0 in range(start, end, BLOCK):
        row, ok = _pool_rows(tab, n0, end, kh, KVH, PS, BLOCK)  # [BLOCK] pool rows
        k = _load_dequant(k_ptr, ks_ptr, kz_ptr, row, d, gi, ok, q.dtype, G, D, ASYM, DENSE)  # [BLOCK, D]

        qk = tl.dot(q, tl.trans(k)) * qk_scale  # [QP, BLOCK] (log2 units)
        qk = tl.where(ok[None, :], qk, float("-inf"))
        p, alpha, m, l = _online_softmax(qk, m, l)
        v = _load_dequant(v_ptr, vs_ptr, vz_ptr, row, d, gi, ok, q.dtype, G, D, ASYM, DENSE)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
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


def int8_paged_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    k_zeros: torch.Tensor | None,
    v_zeros: torch.Tensor | None,
    page_table: torch.Tensor,
    seqlens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    block_n: int = DEFAULT_CONFIG["block_n"],
    num_warps: int = DEFAULT_CONFIG["num_warps"],
    num_stages: int = DEFAULT_CONFIG["num_stages"],
    pdl: bool = False,
) -> torch.Tensor:
    """q [B, HQ, D] -> out [B, HQ, D] (q's dtype). k/v [P, ps, KVH, D] int8 (one layer), scales/zeros
    [P, ps, KVH, G] fp16, page_table [B, W] int32, seqlens [B] int32 (>= 1: keys 0..seqlens-1 are attended).
    k_scales None: k/v are a dense pool in q's dtype (no dequantization). The kernel follows from the pool's shape
    (the module docstring says which); block_n / num_warps / num_stages are its launch. `pdl`: programmatic
    dependent launch (Hopper; kernels/gemv.py says how the decode chain uses it)."""
    b, hq, d = q.shape
    _, ps, kvh, _ = k.shape
    dense = k_scales is None
    if k_scales is None:
        k_scales = v_scales = k  # dense: unused pointers
    g = 1 if dense else k_scales.shape[-1]
    qpk = hq // kvh
    qp = max(16, triton.next_power_of_2(qpk))
    assert q.stride(-1) == 1 and k.is_contiguous() and v.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    direct = num_splits == 1
    if direct:
        po = pml = out  # unused
    else:
        po = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
        pml = torch.empty(b, hq, num_splits, 2, dtype=torch.float32, device=q.device)
    asym = k_zeros is not None
    launch = dict(launch_pdl=True) if pdl else {}
    if not dense and not asym and g == 2 and d % 8 == 0:  # two groups per head: fold2 or the lean loop
        kernel = _planes_decode_kernel if reads_planes(d, g, asym) else _decode_kernel_fold2
        kernel[(b, kvh, num_splits)](
            q,
            q.stride(0),
            q.stride(1),
            k.view(torch.int32),  # [P, ps, KVH, D/4] words
            v.view(torch.int32),
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
    else:
        _decode_kernel[(b, kvh, num_splits)](
            q,
            q.stride(0),
            q.stride(1),
            k,
            v,
            k_scales,
            v_scales,
            k_zeros if asym else k_scales,
            v_zeros if asym else v_scales,
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
            G=g,
            ASYM=asym,
            DIRECT=direct,
            BLOCK=block_n,
            DENSE=dense,
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
