"""The int8 decode kernel for symmetric pools with two scale groups per head (`fold_scales`): the scales fold out of
the tiles, and K / V convert int8 -> fp16 with byte permutes, read as bytes, as int32 words, or as byte planes
straight into the tensor-core operand layout (the default: `int8_decode_attention.DEFAULT_CONFIG` says why).
`int8_decode_attention.int8_paged_decode` launches it; `int8_planes_decode.py` is its lean-loop variant.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.engine.kernels.paged_decode_common import _online_softmax, _pool_rows, _split_range, _store_split_stats


@triton.jit
def _s8_to_f16(x):
    """int8 tile -> the same values in fp16, exactly, with integer ops: for each byte b, the fp16 with bits
    0x64 | (b ^ 0x80) is 1024 + (b + 128); one packed fp16 subtraction of 1152 leaves b. Four bytes per
    instance: one xor, two byte permutes, two subtractions (vs four int -> float conversions)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, hi, off;
        mov.b32 hi, 0x64646464;
        mov.b32 off, 0x64806480;
        xor.b32 t, $2, 0x80808080;
        prmt.b32 $0, t, hi, 0x5150;
        prmt.b32 $1, t, hi, 0x5352;
        sub.f16x2 $0, $0, off;
        sub.f16x2 $1, $1, off;
        }""",
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
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
def _words_to_planes(w):
    """int32 words [.., N] (four int8 each) -> byte planes 0..3 as fp16 [.., N] (plane r: byte r of each word),
    exactly; two words per asm instance so that each output register holds one plane's pair of neighbouring words
    (the tensor-core operand layout wants plane-major pairs, no repacking)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x0, x1, t01, t23, hi, off;
        mov.b32 hi, 0x64646464;
        mov.b32 off, 0x64806480;
        xor.b32 x0, $4, 0x80808080;
        xor.b32 x1, $5, 0x80808080;
        prmt.b32 t01, x0, x1, 0x5140;
        prmt.b32 t23, x0, x1, 0x7362;
        prmt.b32 $0, t01, hi, 0x4140;
        prmt.b32 $1, t01, hi, 0x4342;
        prmt.b32 $2, t23, hi, 0x4140;
        prmt.b32 $3, t23, hi, 0x4342;
        sub.f16x2 $0, $0, off;
        sub.f16x2 $1, $1, off;
        sub.f16x2 $2, $2, off;
        sub.f16x2 $3, $3, off;
        }""",
        constraints="=r,=r,=r,=r,r,r",
        args=[w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _plane_scores(q_a, q_b, q_c, q_d, wptrs, ok):
    """Scores [QP, BLOCK] of one half: q's byte-plane columns (q_r [QP, J] = q[:, 4j + r]) against the K words at
    `wptrs` [BLOCK, J], one K=J dot per plane; the conversion lands in the dot operand layout (no shared-memory
    round trip for K)."""
    k_a, k_b, k_c, k_d = _words_to_planes(tl.load(wptrs, mask=ok[:, None], other=0))
    s = tl.dot(q_a, tl.trans(k_a))
    s = tl.dot(q_b, tl.trans(k_b), s)
    s = tl.dot(q_c, tl.trans(k_c), s)
    return tl.dot(q_d, tl.trans(k_d), s)


@triton.jit
def _plane_pv(p, wptrs, ok, acc_a, acc_b, acc_c, acc_d, alpha):
    """P [QP, BLOCK] (fp16) times one half of V read as int32 words at `wptrs` [BLOCK, J], by byte planes: plane r
    [BLOCK, J] (column j = the half's column 4j + r) converts straight into the dot's operand layout (key pairs in
    one register, no shared-memory round trip for V); acc_r [QP, J] are the output columns 4j + r."""
    v_a, v_b, v_c, v_d = _words_to_planes(tl.load(wptrs, mask=ok[:, None], other=0))
    acc_a = tl.dot(p, v_a, acc_a * alpha[:, None])
    acc_b = tl.dot(p, v_b, acc_b * alpha[:, None])
    acc_c = tl.dot(p, v_c, acc_c * alpha[:, None])
    acc_d = tl.dot(p, v_d, acc_d * alpha[:, None])
    return acc_a, acc_b, acc_c, acc_d


@triton.jit
def _store_planes(ptrs, acc_a, acc_b, acc_c, acc_d, mask):
    """Plane accumulators [QP, J] to columns 4j + r at `ptrs` [QP, J] (column 4j of the half)."""
    tl.store(ptrs, acc_a.to(ptrs.dtype.element_ty), mask=mask)
    tl.store(ptrs + 1, acc_b.to(ptrs.dtype.element_ty), mask=mask)
    tl.store(ptrs + 2, acc_c.to(ptrs.dtype.element_ty), mask=mask)
    tl.store(ptrs + 3, acc_d.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _store_plane_output(
    out_ptr, out_sb, out_sh, po_ptr, pml_ptr, b, heads, qmask, sp, num_splits, m, l,
    a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, HQ: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr,
):  # fmt: skip
    """The plane accumulators [QP, D/8] of both halves (columns 4j + r) to the output rows of query heads `heads`
    (DIRECT: normalized by l), or to split `sp`'s partial rows and statistics for `_combine_kernel`."""
    H: tl.constexpr = D // 2
    jw4 = 4 * tl.arange(0, H // 4)[None, :]  # [1, H/4]
    if DIRECT:
        inv = 1.0 / l[:, None]
        o4 = out_ptr + b.to(tl.int64) * out_sb + heads[:, None] * out_sh + jw4
        _store_planes(o4, a0a * inv, a0b * inv, a0c * inv, a0d * inv, qmask[:, None])
        _store_planes(o4 + H, a1a * inv, a1b * inv, a1c * inv, a1d * inv, qmask[:, None])
    else:
        part = _store_split_stats(pml_ptr, b, heads, sp, num_splits, HQ, m, l, qmask)  # [QP]
        p4 = po_ptr + part[:, None] * D + jw4
        _store_planes(p4, a0a, a0b, a0c, a0d, qmask[:, None])
        _store_planes(p4 + H, a1a, a1b, a1c, a1d, qmask[:, None])


@triton.jit
def _load_q_planes(qrow, qmask):
    """q columns 4j + r (r = 0..3) at `qrow` [QP, J] (column 4j of the half) as fp16 [QP, J] each."""
    a = tl.load(qrow, mask=qmask[:, None], other=0.0).to(tl.float16)
    b = tl.load(qrow + 1, mask=qmask[:, None], other=0.0).to(tl.float16)
    c = tl.load(qrow + 2, mask=qmask[:, None], other=0.0).to(tl.float16)
    d = tl.load(qrow + 3, mask=qmask[:, None], other=0.0).to(tl.float16)
    return a, b, c, d


@triton.jit
def _load_halves(ptrs, ok, H: tl.constexpr, dt, BYTES: tl.constexpr):
    """Both halves [BLOCK, H] of int8 rows at `ptrs` [BLOCK, H] (first half) as `dt` values."""
    x0 = tl.load(ptrs, mask=ok[:, None], other=0)
    x1 = tl.load(ptrs + H, mask=ok[:, None], other=0)
    if BYTES:
        return _s8_to_f16(x0), _s8_to_f16(x1)
    return x0.to(dt), x1.to(dt)


@triton.jit
def _load_scale_pair(s_ptr, row, ok):
    """Both group scales of rows `row` [BLOCK] as fp32 [BLOCK] each, read as one 4-byte pair per row (one gather
    instead of two: scattered 2-byte loads cost L1 wavefronts like whole tile rows)."""
    pair = tl.load(s_ptr + row[:, None] * 2 + tl.arange(0, 2)[None, :], mask=ok[:, None], other=0.0)  # [BLOCK, 2]
    s0, s1 = tl.split(pair.to(tl.float32))
    return s0, s1


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
    BYTES: tl.constexpr,
    WORDS: tl.constexpr,
    KPLANES: tl.constexpr = False,
    VPLANES: tl.constexpr = False,
):
    """`_decode_kernel` for a symmetric int8 pool with two scale groups per head (group = head_dim / 2, the
    default 64 at head_dim 128), scales folded out of the tiles: each half of K and V is read as its own
    [BLOCK, D/2] tile and converted int8 -> q's dtype exactly (no multiply, no reshape); QK^T is the sum of two
    dots, each scaled per key on the [QP, BLOCK] scores; P is scaled per value before each half's PV dot.
    BYTES: the dots run in fp16 on tiles converted by `_s8_to_f16` (q and P rounded to fp16 instead of q's dtype).
    KPLANES (with WORDS): QK^T as four dots per half over K's byte planes (`_plane_scores`) with q's columns
    permuted to match (a dot product does not depend on the order of its terms).
    VPLANES (with KPLANES): PV as four dots per half over V's byte planes (`_plane_pv`), the output columns
    permuted back at the store."""
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
    q0 = tl.load(qrow, mask=qmask[:, None], other=0.0)  # [QP, H]
    q1 = tl.load(qrow + H, mask=qmask[:, None], other=0.0)
    if KPLANES:  # [QP, H/4] planes of each half (column 4j + r)
        jw = tl.arange(0, H // 4)
        qw = q_ptr + b.to(tl.int64) * q_sb + heads[:, None] * q_sh + 4 * jw[None, :]
        q0a, q0b, q0c, q0d = _load_q_planes(qw, qmask)
        q1a, q1b, q1c, q1d = _load_q_planes(qw + H, qmask)
    if BYTES or WORDS:
        q0 = q0.to(tl.float16)
        q1 = q1.to(tl.float16)
    dt = q0.dtype
    m = tl.full([QP], float("-inf"), tl.float32)
    l = tl.zeros([QP], tl.float32)
    if VPLANES:  # [QP, H/4] per plane r of each half: output columns 4j + r
        a0a = tl.zeros([QP, H // 4], tl.float32)
        a0b = tl.zeros([QP, H // 4], tl.float32)
        a0c = tl.zeros([QP, H // 4], tl.float32)
        a0d = tl.zeros([QP, H // 4], tl.float32)
        a1a = tl.zeros([QP, H // 4], tl.float32)
        a1b = tl.zeros([QP, H // 4], tl.float32)
        a1c = tl.zeros([QP, H // 4], tl.float32)
        a1d = tl.zeros([QP, H // 4], tl.float32)
    else:
        acc0 = tl.zeros([QP, H], tl.float32)
        acc1 = tl.zeros([QP, H], tl.float32)
    tab = table_ptr + b.to(tl.int64) * table_stride
    for n0 in range(start, end, BLOCK):
        row, ok = _pool_rows(tab, n0, end, kh, KVH, PS, BLOCK)  # [BLOCK] pool rows
        kv_off = row[:, None] * D + c[None, :]  # [BLOCK, H]
        if WORDS:  # k_ptr/v_ptr: the pool as int32 words [rows, D/4]
            w_off = row[:, None] * (D // 4) + tl.arange(0, H // 4)[None, :]  # [BLOCK, H/4]
        ks0, ks1 = _load_scale_pair(ks_ptr, row, ok)  # [BLOCK] each
        if KPLANES:
            s0 = _plane_scores(q0a, q0b, q0c, q0d, k_ptr + w_off, ok)  # [QP, BLOCK]
            s1 = _plane_scores(q1a, q1b, q1c, q1d, k_ptr + w_off + H // 4, ok)
            qk = s0 * ks0[None, :] + s1 * ks1[None, :]
        else:
            if WORDS:
                k0 = _load_words_f16(k_ptr + w_off, ok, BLOCK, H)  # [BLOCK, H]
                k1 = _load_words_f16(k_ptr + w_off + H // 4, ok, BLOCK, H)
            else:
                k0, k1 = _load_halves(k_ptr + kv_off, ok, H, dt, BYTES)  # [BLOCK, H] each
            qk = tl.dot(q0, tl.trans(k0)) * ks0[None, :] + tl.dot(q1, tl.trans(k1)) * ks1[None, :]
        qk = tl.where(ok[None, :], qk * qk_scale, float("-inf"))  # [QP, BLOCK] (log2)
        p, alpha, m, l = _online_softmax(qk, m, l)
        vs0, vs1 = _load_scale_pair(vs_ptr, row, ok)
        if VPLANES:
            p0 = (p * vs0[None, :]).to(tl.float16)
            p1 = (p * vs1[None, :]).to(tl.float16)
            a0a, a0b, a0c, a0d = _plane_pv(p0, v_ptr + w_off, ok, a0a, a0b, a0c, a0d, alpha)
            a1a, a1b, a1c, a1d = _plane_pv(p1, v_ptr + w_off + H // 4, ok, a1a, a1b, a1c, a1d, alpha)
        else:
            if WORDS:
                v0 = _load_words_f16(v_ptr + w_off, ok, BLOCK, H)
                v1 = _load_words_f16(v_ptr + w_off + H // 4, ok, BLOCK, H)
            else:
                v0, v1 = _load_halves(v_ptr + kv_off, ok, H, dt, BYTES)
            acc0 = acc0 * alpha[:, None] + tl.dot((p * vs0[None, :]).to(dt), v0)
            acc1 = acc1 * alpha[:, None] + tl.dot((p * vs1[None, :]).to(dt), v1)
    if VPLANES:  # columns 4j + r of each half, from its plane accumulators
        _store_plane_output(
            out_ptr, out_sb, out_sh, po_ptr, pml_ptr, b, heads, qmask, sp, num_splits, m, l,
            a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, KVH * QPK, D, DIRECT,
        )  # fmt: skip
    elif DIRECT:
        orow = out_ptr + b.to(tl.int64) * out_sb + heads[:, None] * out_sh + c[None, :]
        tl.store(orow, (acc0 / l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask[:, None])
        tl.store(orow + H, (acc1 / l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask[:, None])
    else:
        part = _store_split_stats(pml_ptr, b, heads, sp, num_splits, KVH * QPK, m, l, qmask)  # [QP]
        tl.store(po_ptr + part[:, None] * D + c[None, :], acc0, mask=qmask[:, None])
        tl.store(po_ptr + part[:, None] * D + H + c[None, :], acc1, mask=qmask[:, None])
