"""Decode attention that reads the int8 paged KV pool directly and dequantizes in registers (split-K "flash
decoding"): one program per (sequence, KV head, split) walks its share of the sequence's pages, keeps an online
softmax for the KV head's group of query heads (padded to 16 rows for tensor-core dots), and a second kernel
merges the splits. Nothing is dequantized to memory: it moves 1 byte per K/V element (+ the fp16 scales)
where dequantize-then-FA3 moves 1 + 2 + 2. The same kernel reads a dense (bf16/fp16) pool when given no scales
(`paged_decode`), which bench/gpu_engine.py compares with FA3's paged decode.

This file: the launch configs, the tile kernel (any group count, asymmetric pools, dense pools) and the launcher
`int8_paged_decode`. The fold-scales kernel and its byte-plane conversions are in int8_fold2_decode.py, its
lean-loop variant (the default for symmetric pools with two groups per head and head_dim >= 128) in
int8_planes_decode.py, and what all decode
kernels share (page walk, softmax step, split merge) in paged_decode_common.py.

Graph-safe: the grid depends only on the batch size and `num_splits`; each split's token range is computed
on the device from `seqlens` (a split past the end of a short sequence does nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.kernels.int8_fold2_decode import _decode_kernel_fold2
from pdserve.engine.kernels.kv_quant import dequantize_tile
from pdserve.engine.kernels.paged_decode_common import (
    _combine_kernel,
    _online_softmax,
    _pool_rows,
    _split_range,
    _store_split_stats,
    default_num_splits,
)

__all__ = ["DEFAULT_CONFIG", "DENSE_CONFIG", "TILE_LAUNCH", "default_num_splits", "int8_paged_decode"]

# Launch configs: the winners of bench/gpu_engine.py's sweep on an H200 (docs/benchmarks.md), int8 and dense pools.
# scale_expand: broadcast each group's scale (and zero) over its columns with G selects instead of reshaping the
# int8 tile into [BLOCK, G, D/G] groups (it did not win).
# fold_scales: symmetric int8 pools with two scale groups per head only (`_decode_kernel_fold2`), else ignored;
# on by default: faster per layer than the tile kernel at batch 64/128 and more accurate against fp32 attention
# (figures: docs/benchmarks.md, docs/bench/int8_decode.json).
# byte_convert (fold_scales kernel only): int8 -> fp16 with byte permutes (`_s8_to_f16`) instead of the GPU's
# int -> float conversion instructions, which run at a quarter of the integer rate and bound the kernel.
# word_loads (fold_scales kernel only): read the int8 pool as int32 words and convert them in the load layout
# (`_load_words_f16`), so tiles reach the tensor-core operand layout as fp16 through ldmatrix instead of one
# 8-bit shared-memory load per element.
# k_planes (word_loads kernel only): QK^T over K's four byte planes (`_plane_scores`): K converts straight into the
# tensor-core operand layout with two words per conversion (no repacking moves, no shared-memory round trip for K):
# 38.7 -> 37.0 warp instructions per key (SASS); on an H200 0-2.5% faster per layer at batch 64/128 x context 2k/8k
# and 4% of the kernel's time in an engine step (2026-12-01, bench/kv_formats.py; docs/benchmarks.md).
# v_planes (k_planes kernel only): PV over V's byte planes too (`_plane_pv`): V converts straight into the operand
# layout and P never leaves the warp's registers. Each dot's output is then [16, D/8] wide, so it pays only with one
# warp per program (more warps would compute the same small tiles again): num_warps 1, 32-key blocks, 3 stages. On
# an H200 (2026-12-01, ninth session, bench/kv_formats.py --sweep over planes x splits x block x stages x warps):
# batch 128 at context 2k 169 us per layer (80% of copy bandwidth) against 221 us (59%) for the previous default
# (4 warps, 128-key blocks, V through shared memory); context 8k 622 us (87%) against 802; one warp without V planes:
# 182 us. SASS: 31.0 warp instructions per (key, KV head) against 35.9, no barriers in the loop.
# split_mult 5 (about one wave of resident programs): batch 64 gets 2 splits, batch 128 one (the sweep's best for
# both at context 2k with one-warp programs).
# lean_loop (k_planes + v_planes only): the same reads through int8_planes_decode.py, 22.9 warp instructions per key
# against 31.0 (SASS before its offset flushes, which add ~0.5). A decode step runs at the power limit, where this
# kernel is issue bound. On an H200 (2026-12-01, eleventh session) b128 ctx2k 159 us per layer (82%) against 164,
# ctx 8k 602 against 635; the 8B engine's step at b128 ctx2k 11.14 ms against bf16's 13.56 (the byte-plane kernel:
# 12.45 against 13.71 in an earlier run).
DEFAULT_CONFIG = dict(
    block_n=32,
    num_warps=1,
    num_stages=3,
    split_mult=5,
    scale_expand=False,
    fold_scales=True,
    byte_convert=True,
    word_loads=True,
    k_planes=True,
    v_planes=True,
    lean_loop=True,
)
# The launch shape for int8 pools the byte-plane kernel does not read (asymmetric pools, group counts other than two
# per head, head_dim < 128, or planes switched off): the default before the ninth session. Its one-warp sweep
# measured the plane kernel only (`int8_launch_config` in engine/attention.py picks).
TILE_LAUNCH = dict(block_n=128, num_warps=4, num_stages=3)
DENSE_CONFIG = dict(
    block_n=64,
    num_warps=4,
    num_stages=3,
    split_mult=2,
    scale_expand=False,
    fold_scales=False,
    byte_convert=False,
    word_loads=False,
    k_planes=False,
    v_planes=False,
    lean_loop=False,
)


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
    EXPAND: tl.constexpr,
):
    """Rows `row` [BLOCK] of one head: [BLOCK, D] in `dtype` (int8 pages dequantized in registers)."""
    x = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=ok[:, None], other=0)
    if DENSE:
        return x.to(dtype)
    if EXPAND:
        grp = (d // (D // G))[None, :]
        s = tl.zeros(x.shape, tl.float32)
        z = tl.zeros(x.shape, tl.float32)
        for gg in tl.static_range(G):
            sg = tl.load(s_ptr + row * G + gg, mask=ok, other=0.0).to(tl.float32)
            s = tl.where(grp == gg, sg[:, None], s)
            if ASYM:
                zg = tl.load(z_ptr + row * G + gg, mask=ok, other=0.0).to(tl.float32)
                z = tl.where(grp == gg, zg[:, None], z)
        xf = x.to(tl.float32) * s
        if ASYM:
            xf = (z + 128.0 * s) + xf
        return xf.to(dtype)
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
    EXPAND: tl.constexpr,
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
        k = _load_dequant(k_ptr, ks_ptr, kz_ptr, row, d, gi, ok, q.dtype, G, D, ASYM, DENSE, EXPAND)  # [BLOCK, D]

        qk = tl.dot(q, tl.trans(k)) * qk_scale  # [QP, BLOCK] (log2 units)
        qk = tl.where(ok[None, :], qk, float("-inf"))
        p, alpha, m, l = _online_softmax(qk, m, l)
        v = _load_dequant(v_ptr, vs_ptr, vz_ptr, row, d, gi, ok, q.dtype, G, D, ASYM, DENSE, EXPAND)
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
    scale_expand: bool = bool(DEFAULT_CONFIG["scale_expand"]),  # the dict holds ints and bools
    fold_scales: bool = bool(DEFAULT_CONFIG["fold_scales"]),
    byte_convert: bool = bool(DEFAULT_CONFIG["byte_convert"]),
    word_loads: bool = bool(DEFAULT_CONFIG["word_loads"]),
    k_planes: bool = bool(DEFAULT_CONFIG["k_planes"]),
    v_planes: bool = bool(DEFAULT_CONFIG["v_planes"]),
    lean_loop: bool = bool(DEFAULT_CONFIG["lean_loop"]),
    pdl: bool = False,
) -> torch.Tensor:
    """q [B, HQ, D] -> out [B, HQ, D] (q's dtype). k/v [P, ps, KVH, D] int8 (one layer), scales/zeros
    [P, ps, KVH, G] fp16, page_table [B, W] int32, seqlens [B] int32 (>= 1: keys 0..seqlens-1 are attended).
    k_scales None: k/v are a dense pool in q's dtype (no dequantization). `pdl`: programmatic dependent launch
    (Hopper; kernels/gemv.py says how the decode chain uses it)."""
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
    if fold_scales and not dense and not asym and g == 2:
        words = word_loads and d % 8 == 0
        kplanes = words and k_planes and d >= 128  # planes of D/8 >= 16 columns (a dot's K)
        if kplanes and v_planes and lean_loop:
            from pdserve.engine.kernels.int8_planes_decode import _planes_decode_kernel

            kernel, extra = _planes_decode_kernel, {}
        else:
            kernel = _decode_kernel_fold2
            extra = dict(BYTES=byte_convert, WORDS=words, KPLANES=kplanes, VPLANES=kplanes and v_planes)
        kernel[(b, kvh, num_splits)](
            q,
            q.stride(0),
            q.stride(1),
            k.view(torch.int32) if words else k,  # [P, ps, KVH, D/4] words
            v.view(torch.int32) if words else v,
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
            **extra,
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
            EXPAND=scale_expand,
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
