"""The int8 decode kernel for symmetric pools with two scale groups per head and head_dim below 128 (`fold2`): the
scales fold out of the tiles, and K / V are read as int32 words and converted int8 -> fp16 exactly with byte
permutes (`_words_to_f16`) instead of the GPU's int -> float conversions, which run at a quarter of the integer rate.

Who picks it: `int8_decode_attention.int8_paged_decode`, by the pool's shape (symmetric, two groups per head,
head_dim a multiple of 8 below 128, e.g. head_dim 64 with kv_group_size 32). At head_dim >= 128 the lean loop
(int8_planes_decode.py) reads the same pools; every other int8 pool takes the tile kernel in
int8_decode_attention.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.engine.kernels.paged_decode_common import (
    _load_scale_pair,
    _online_softmax,
    _pool_rows,
    _split_range,
    _store_split_stats,
)


@triton.jit
def _words_to_f16(w):
    """int32 words [..] (four int8 each) -> four fp16 tensors [..]: bytes 0..3 of each word, exactly."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, a, b, hi, off;
        mov.b32 hi, 0x64646464;
        mov.b32 off, 0x64806480;
        xor.b32 t, $4, 0x80808080;
        prmt.b32 a, t, hi, 0x5150;
        prmt.b32 b, t, hi, 0x5352;
        sub.f16x2 a, a, off;
        sub.f16x2 b, b, off;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b;
        }""",
        constraints="=h,=h,=h,=h,r",
        args=[w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _load_words_f16(wptrs, ok, BLOCK: tl.constexpr, H: tl.constexpr):
    """int8 rows read as int32 words at `wptrs` [BLOCK, H/4] -> fp16 [BLOCK, H] (column 4j + r: byte r of word j)."""
    e0, e1, e2, e3 = _words_to_f16(tl.load(wptrs, mask=ok[:, None], other=0))
    x = tl.join(
        tl.join(e0, e2), tl.join(e1, e3)
    )  # [BLOCK, H/4, 2, 2]: [.., u, v] = byte 2u + v (join adds the last dim)
    return tl.reshape(x, (BLOCK, H))


@triton.jit
def _decode_kernel_fold2(
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
    """`_decode_kernel` for a symmetric int8 pool with two scale groups per head (group = head_dim / 2), scales
    folded out of the tiles: each half of K and V is read as int32 words ([rows, D/4], k_ptr / v_ptr) into its own
    [BLOCK, D/2] fp16 tile, exactly (no multiply, no reshape); QK^T is the sum of two dots, each scaled per key on
    the [QP, BLOCK] scores; P is scaled per value before each half's PV dot. The dots run in fp16 (q and P rounded
    to fp16). ks_ptr / vs_ptr: fp16 [rows, 2]."""
    H: tl.constexpr = D // 2
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    start, end = _split_range(seqlens_ptr, b, sp, num_splits, BLOCK, USE_PDL)

    qi = tl.arange(0, QP)
    qmask = qi < QPK
    c = tl.arange(0, H)
    heads = kh * QPK + qi
    qrow = q_ptr + b.to(tl.int64) * q_sb + heads[:, None] * q_sh + c[None, :]
    q0 = tl.load(qrow, mask=qmask[:, None], other=0.0).to(tl.float16)  # [QP, H]
    q1 = tl.load(qrow + H, mask=qmask[:, None], other=0.0).to(tl.float16)
    m = tl.full([QP], float("-inf"), tl.float32)
    l = tl.zeros([QP], tl.float32)
    acc0 = tl.zeros([QP, H], tl.float32)
    acc1 = tl.zeros([QP, H], tl.float32)
    tab = table_ptr + b.to(tl.int64) * table_stride
    for n0 in range(start, end, BLOCK):
        row, ok = _pool_rows(tab, n0, end, kh, KVH, PS, BLOCK)  # [BLOCK] pool rows
        w_off = row[:, None] * (D // 4) + tl.arange(0, H // 4)[None, :]  # [BLOCK, H/4] words
        ks0, ks1 = _load_scale_pair(ks_ptr, row, ok)  # [BLOCK] each
        k0 = _load_words_f16(k_ptr + w_off, ok, BLOCK, H)  # [BLOCK, H]
        k1 = _load_words_f16(k_ptr + w_off + H // 4, ok, BLOCK, H)
        qk = tl.dot(q0, tl.trans(k0)) * ks0[None, :] + tl.dot(q1, tl.trans(k1)) * ks1[None, :]
        qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))  # [QP, BLOCK] (log2)
        p, alpha, m, l = _online_softmax(qk, m, l)
        vs0, vs1 = _load_scale_pair(vs_ptr, row, ok)
        v0 = _load_words_f16(v_ptr + w_off, ok, BLOCK, H)
        v1 = _load_words_f16(v_ptr + w_off + H // 4, ok, BLOCK, H)
        acc0 = acc0 * alpha[:, None] + tl.dot((p * vs0[None, :]).to(tl.float16), v0)
        acc1 = acc1 * alpha[:, None] + tl.dot((p * vs1[None, :]).to(tl.float16), v1)
    if DIRECT:
        orow = out_ptr + b.to(tl.int64) * out_sb + heads[:, None] * out_sh + c[None, :]
        tl.store(orow, (acc0 / l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask[:, None])
        tl.store(orow + H, (acc1 / l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask[:, None])
    else:
        part = _store_split_stats(pml_ptr, b, heads, sp, num_splits, KVH * QPK, m, l, qmask)  # [QP]
        tl.store(po_ptr + part[:, None] * D + c[None, :], acc0, mask=qmask[:, None])
        tl.store(po_ptr + part[:, None] * D + H + c[None, :], acc1, mask=qmask[:, None])
