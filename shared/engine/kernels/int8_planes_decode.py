"""The lean-loop int8 decode kernel: the default for symmetric pools with two fp16 scale groups per head and head_dim
>= 128 (e.g. head_dim 128 at kv_group_size 64).

Who picks it: `int8_decode_attention.int8_paged_decode`, by the pool's shape, with the launch config
`int8_decode_attention.DEFAULT_CONFIG` (`attention.int8_launch_config` chooses it for the same shapes). Other
symmetric two-group pools (head_dim < 128) take int8_fold2_decode.py, every other int8 pool the tile kernel.

K and V are read as int32 words ([rows, D/4]) and converted by byte planes straight into the tensor-core operand
layout: plane r of a half holds byte r of each word, so QK^T is four K=D/8 dots per half against q's columns 4j + r,
and PV four dots per half whose accumulators are output columns 4j + r (permuted back at the store). No shared-memory
round trip for K or V, and P never leaves the warp's registers; each dot is only [16, D/8] wide, so a program is one
warp. In a decode step the GPU runs at its power limit and lower clocks, where this kernel is bound by instruction
issue rather than bytes, so the loop also drops three kinds of work:

1. **Offsets folded out of the conversion.** A byte b becomes the fp16 value 1152 + b (bit tricks only: xor and two
   byte permutes, no subtraction). The 1152 comes back out of the dots instead of out of every element:
   - QK^T: each half's first dot starts from -1152 * sum(q) of that half, per query row;
   - PV: each half also accumulates sum(P) (a dot of P with ones), and every `FLUSH_BLOCKS` blocks (and at the
     end) the accumulators subtract 1152 times it, which starts again from zero. The tensor cores round each
     accumulation toward zero, so an accumulator that carried 1152 * sum(P) of a whole sequence would drift with its
     length (the offset is ~1000x the true sum where the output is near V's mean); flushed every four blocks, the
     drift is bounded by four blocks' offset whatever the length.
   QK^T's offset lives within one block's dots and needs no flush.
2. **Lazy rescaling.** The running max moves only when a block's max exceeds it by more than `RESCALE_LOG2` (log2
   units). Until then P = exp2(s - m) <= 2^RESCALE_LOG2 and the accumulators are not multiplied by alpha = 1.
   (acc, sum, max) stay consistent with each other, so the result is unchanged up to rounding. The bound keeps fp16
   P * v_scale finite for |v| up to 2^15 / 2^RESCALE_LOG2 * 127.
3. **Masks only on the last block.** Full blocks load without predicates and skip the -inf select; the softmax
   scale is folded into the per-key K scales, and P times the V scales is one fp16 multiply per pair of keys (P is
   rounded to fp16 first, the product again: the dot's operand is fp16 either way).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pdserve.engine.kernels.paged_decode_common import _load_scale_pair, _pool_rows, _split_range, _store_split_stats

OFFSET = tl.constexpr(1152.0)  # fp16 0x6480: 1024 (the 0x64 exponent byte) + 128 (the xor: signed -> unsigned)
RESCALE_LOG2 = tl.constexpr(4.0)
FLUSH_BLOCKS = tl.constexpr(4)  # the PV accumulators drop their 1152 * sum(P) every this many blocks


@triton.jit
def _words_to_offset_planes(w):
    """int32 words [.., N] (four int8 each) -> byte planes 0..3 as fp16 [.., N] (plane r: byte r of each word) holding
    1152 + byte, exactly: for each byte b, the fp16 with bits 0x64 | (b ^ 0x80) is 1024 + (b + 128) (xor and byte
    permutes only; two words per asm instance, so that each output register holds one plane's pair of neighbouring
    words, the tensor-core operand layout)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x0, x1, t01, t23, hi;
        mov.b32 hi, 0x64646464;
        xor.b32 x0, $4, 0x80808080;
        xor.b32 x1, $5, 0x80808080;
        prmt.b32 t01, x0, x1, 0x5140;
        prmt.b32 t23, x0, x1, 0x7362;
        prmt.b32 $0, t01, hi, 0x4140;
        prmt.b32 $1, t01, hi, 0x4342;
        prmt.b32 $2, t23, hi, 0x4140;
        prmt.b32 $3, t23, hi, 0x4342;
        }""",
        constraints="=r,=r,=r,=r,r,r",
        args=[w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )


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
def _rows(tab, n0, end, kh, KVH: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Pool rows [BLOCK] of keys n0 .. n0 + BLOCK - 1 of KV head `kh`, their `ok` [BLOCK] (key < end),
    read without predicates in a full block."""
    if MASKED:
        return _pool_rows(tab, n0, end, kh, KVH, PS, BLOCK)
    t = n0 + tl.arange(0, BLOCK)
    page = tl.load(tab + t // PS).to(tl.int64)
    return (page * PS + t % PS) * KVH + kh, t < end


@triton.jit
def _scales(s_ptr, row, ok, MASKED: tl.constexpr):
    """Both group scales of rows `row` [BLOCK] as fp32 [BLOCK] each."""
    if MASKED:
        return _load_scale_pair(s_ptr, row, ok)
    pair = tl.load(s_ptr + row[:, None] * 2 + tl.arange(0, 2)[None, :])  # [BLOCK, 2]
    s0, s1 = tl.split(pair.to(tl.float32))
    return s0, s1


@triton.jit
def _scales_f16(s_ptr, row, ok, MASKED: tl.constexpr):
    """Both group scales of rows `row` [BLOCK] as stored (fp16 [BLOCK] each)."""
    if MASKED:
        pair = tl.load(s_ptr + row[:, None] * 2 + tl.arange(0, 2)[None, :], mask=ok[:, None], other=0.0)
    else:
        pair = tl.load(s_ptr + row[:, None] * 2 + tl.arange(0, 2)[None, :])  # [BLOCK, 2]
    s0, s1 = tl.split(pair)
    return s0, s1


@triton.jit
def _load_words(wptrs, ok, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(wptrs, mask=ok[:, None], other=0)
    return tl.load(wptrs)


@triton.jit
def _offset_scores(q_a, q_b, q_c, q_d, init, wptrs, ok, MASKED: tl.constexpr):
    """q (byte-plane columns of one half) against 1152 + K's planes at `wptrs` [BLOCK, J], starting from `init`
    [QP, BLOCK] = -1152 * sum(q of the half): the half's q.k [QP, BLOCK]."""
    k_a, k_b, k_c, k_d = _words_to_offset_planes(_load_words(wptrs, ok, MASKED))
    s = tl.dot(q_a, tl.trans(k_a), init)
    s = tl.dot(q_b, tl.trans(k_b), s)
    s = tl.dot(q_c, tl.trans(k_c), s)
    return tl.dot(q_d, tl.trans(k_d), s)


@triton.jit
def _offset_pv(p, ones, wptrs, ok, acc_a, acc_b, acc_c, acc_d, psum, MASKED: tl.constexpr):
    """P [QP, BLOCK] fp16 times 1152 + V's planes at `wptrs` [BLOCK, J] into acc_r [QP, J]; psum [QP, J] += P's row
    sums (every column the same) for the 1152 to come back out."""
    v_a, v_b, v_c, v_d = _words_to_offset_planes(_load_words(wptrs, ok, MASKED))
    acc_a = tl.dot(p, v_a, acc_a)
    acc_b = tl.dot(p, v_b, acc_b)
    acc_c = tl.dot(p, v_c, acc_c)
    acc_d = tl.dot(p, v_d, acc_d)
    return acc_a, acc_b, acc_c, acc_d, tl.dot(p, ones, psum)


@triton.jit
def _flush_offsets(a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1):
    """The PV accumulators [QP, J] less 1152 * sum(P) since the last flush (ps_h [QP, J]: every column the row sum,
    a dot output of the accumulators' own shape and layout), and the sums back to zero."""
    a0a, a0b, a0c, a0d = a0a - OFFSET * ps0, a0b - OFFSET * ps0, a0c - OFFSET * ps0, a0d - OFFSET * ps0
    a1a, a1b, a1c, a1d = a1a - OFFSET * ps1, a1b - OFFSET * ps1, a1c - OFFSET * ps1, a1d - OFFSET * ps1
    return a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, tl.zeros_like(ps0), tl.zeros_like(ps1)


@triton.jit
def _block(
    n0, end, tab, kh, k_ptr, v_ptr, ks_ptr, vs_ptr, qk_scale,
    q0a, q0b, q0c, q0d, q1a, q1b, q1c, q1d, init0, init1, ones,
    m, l, a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1,
    KVH: tl.constexpr, PS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One block of keys: scores, lazy online softmax, PV. Returns the updated state (m, l, accumulators, P sums)."""
    H: tl.constexpr = D // 2
    row, ok = _rows(tab, n0, end, kh, KVH, PS, BLOCK, MASKED)  # [BLOCK] pool rows
    w_off = row[:, None] * (D // 4) + tl.arange(0, H // 4)[None, :]  # [BLOCK, H/4] words
    ks0, ks1 = _scales(ks_ptr, row, ok, MASKED)  # [BLOCK] each
    s0 = _offset_scores(q0a, q0b, q0c, q0d, init0, k_ptr + w_off, ok, MASKED)  # [QP, BLOCK]
    s1 = _offset_scores(q1a, q1b, q1c, q1d, init1, k_ptr + w_off + H // 4, ok, MASKED)
    qk = s0 * (ks0 * qk_scale)[None, :] + s1 * (ks1 * qk_scale)[None, :]  # log2 units
    if MASKED:
        qk = tl.where(ok[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))
    if tl.max(m_new - m, 0) > RESCALE_LOG2:  # warp-uniform: rescale only when the max moved far
        alpha = tl.exp2(m - m_new)
        a0a, a0b, a0c, a0d = a0a * alpha[:, None], a0b * alpha[:, None], a0c * alpha[:, None], a0d * alpha[:, None]
        a1a, a1b, a1c, a1d = a1a * alpha[:, None], a1b * alpha[:, None], a1c * alpha[:, None], a1d * alpha[:, None]
        ps0, ps1, l, m = ps0 * alpha[:, None], ps1 * alpha[:, None], l * alpha, m_new
    p = tl.exp2(qk - m[:, None])  # [QP, BLOCK] <= 2^RESCALE_LOG2
    l += tl.sum(p, 1)
    vs0, vs1 = _scales_f16(vs_ptr, row, ok, MASKED)  # fp16 [BLOCK]
    p16 = p.to(tl.float16)  # <= 2^RESCALE_LOG2
    p0 = p16 * vs0[None, :]  # fp16 products (packed multiplies)
    p1 = p16 * vs1[None, :]
    a0a, a0b, a0c, a0d, ps0 = _offset_pv(p0, ones, v_ptr + w_off, ok, a0a, a0b, a0c, a0d, ps0, MASKED)
    a1a, a1b, a1c, a1d, ps1 = _offset_pv(p1, ones, v_ptr + w_off + H // 4, ok, a1a, a1b, a1c, a1d, ps1, MASKED)
    return m, l, a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1


@triton.jit
def _planes_decode_kernel(
    q_ptr, q_sb, q_sh, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, table_stride, seqlens_ptr, po_ptr, pml_ptr,
    out_ptr, out_sb, out_sh, qk_scale, num_splits,
    KVH: tl.constexpr, QPK: tl.constexpr, QP: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
    DIRECT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """k_ptr / v_ptr: one layer's pool as int32 words [rows, D/4]; ks_ptr / vs_ptr: fp16 [rows, 2]. Writes the output
    rows (DIRECT) or the split's partial rows and statistics for `_combine_kernel`, like every decode kernel."""
    H: tl.constexpr = D // 2
    J: tl.constexpr = H // 4
    b = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    start, end = _split_range(seqlens_ptr, b, sp, num_splits, BLOCK, USE_PDL)

    qi = tl.arange(0, QP)
    qmask = qi < QPK
    heads = kh * QPK + qi
    qw = q_ptr + b.to(tl.int64) * q_sb + heads[:, None] * q_sh + 4 * tl.arange(0, J)[None, :]
    q0a, q0b, q0c, q0d = _load_q_planes(qw, qmask)  # [QP, J] fp16: columns 4j + r of the first half
    q1a, q1b, q1c, q1d = _load_q_planes(qw + H, qmask)
    qsum0 = tl.sum(q0a.to(tl.float32) + q0b.to(tl.float32) + q0c.to(tl.float32) + q0d.to(tl.float32), 1)  # [QP]
    qsum1 = tl.sum(q1a.to(tl.float32) + q1b.to(tl.float32) + q1c.to(tl.float32) + q1d.to(tl.float32), 1)
    init0 = tl.zeros([QP, BLOCK], tl.float32) - OFFSET * qsum0[:, None]
    init1 = tl.zeros([QP, BLOCK], tl.float32) - OFFSET * qsum1[:, None]
    ones = tl.full([BLOCK, J], 1.0, tl.float16)

    m = tl.full([QP], float("-inf"), tl.float32)
    l = tl.zeros([QP], tl.float32)
    a0a = tl.zeros([QP, J], tl.float32)
    a0b = tl.zeros([QP, J], tl.float32)
    a0c = tl.zeros([QP, J], tl.float32)
    a0d = tl.zeros([QP, J], tl.float32)
    a1a = tl.zeros([QP, J], tl.float32)
    a1b = tl.zeros([QP, J], tl.float32)
    a1c = tl.zeros([QP, J], tl.float32)
    a1d = tl.zeros([QP, J], tl.float32)
    ps0 = tl.zeros([QP, J], tl.float32)
    ps1 = tl.zeros([QP, J], tl.float32)
    tab = table_ptr + b.to(tl.int64) * table_stride
    full_end = start + (end - start) // BLOCK * BLOCK  # division truncates: a split past the end stays empty
    for n0 in range(start, full_end, BLOCK):
        m, l, a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1 = _block(
            n0, end, tab, kh, k_ptr, v_ptr, ks_ptr, vs_ptr, qk_scale,
            q0a, q0b, q0c, q0d, q1a, q1b, q1c, q1d, init0, init1, ones,
            m, l, a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1, KVH, PS, D, BLOCK, False,
        )  # fmt: skip
        if (n0 - start) % (FLUSH_BLOCKS * BLOCK) == (FLUSH_BLOCKS - 1) * BLOCK:  # warp-uniform
            a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1 = _flush_offsets(
                a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1
            )
    if full_end < end:  # the last, partial block
        m, l, a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1 = _block(
            full_end, end, tab, kh, k_ptr, v_ptr, ks_ptr, vs_ptr, qk_scale,
            q0a, q0b, q0c, q0d, q1a, q1b, q1c, q1d, init0, init1, ones,
            m, l, a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1, KVH, PS, D, BLOCK, True,
        )  # fmt: skip
    a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1 = _flush_offsets(  # what the last flush left
        a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, ps0, ps1
    )
    _store_plane_output(
        out_ptr, out_sb, out_sh, po_ptr, pml_ptr, b, heads, qmask, sp, num_splits, m, l,
        a0a, a0b, a0c, a0d, a1a, a1b, a1c, a1d, KVH * QPK, D, DIRECT,
    )  # fmt: skip
