"""Decode attention that reads the int8 paged KV pool directly and dequantizes in registers (split-K "flash
decoding"): one program per (sequence, KV head, split) walks its share of the sequence's pages, keeps an online
softmax for the KV head's group of query heads (padded to 16 rows for tensor-core dots), and a second kernel
merges the splits. Nothing is dequantized to memory: it moves 1 byte per K/V element (+ the fp16 scales)
where dequantize-then-FA3 moves 1 + 2 + 2. The same kernel reads a dense (bf16/fp16) pool when given no scales
(`paged_decode`), which bench/gpu_engine.py compares with FA3's paged decode.

Graph-safe: the grid depends only on the batch size and `num_splits`; each split's token range is computed
on the device from `seqlens` (a split past the end of a short sequence does nothing).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdserve.engine.kernels.kv_quant import dequantize_tile

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
    lean_loop=False,
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
def _split_range(seqlens_ptr, b, sp, num_splits, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Keys [start, end) of split `sp` of sequence `b`: whole BLOCKs each, empty past a short sequence's end."""
    n = tl.load(seqlens_ptr + b)  # graph inputs: written before the step, never by the previous kernel
    if USE_PDL:  # programmatic dependent launch: q and this step's K/V come from the previous kernel
        gdc_wait()
        gdc_launch_dependents()
    per = tl.cdiv(tl.cdiv(n, num_splits), BLOCK) * BLOCK
    start = sp * per
    return start, tl.minimum(start + per, n)


@triton.jit
def _pool_rows(tab, n0, end, kh, KVH: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr):
    """Pool rows [BLOCK] of keys n0 .. n0 + BLOCK - 1 of KV head `kh` through the page table row `tab`, and
    `ok` [BLOCK]: the key is before `end`."""
    t = n0 + tl.arange(0, BLOCK)
    ok = t < end
    page = tl.load(tab + t // PS, mask=ok, other=0).to(tl.int64)
    return (page * PS + t % PS) * KVH + kh, ok


@triton.jit
def _online_softmax(qk, m, l):
    """Scores qk [QP, BLOCK] (log2 units) into the running max m and sum l [QP]: (p [QP, BLOCK], alpha [QP], the
    factor for what was accumulated before, the new m, the new l)."""
    m_new = tl.maximum(m, tl.max(qk, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def _store_split_stats(pml_ptr, b, heads, sp, num_splits, hq, m, l, qmask):
    """Store split `sp`'s running max and sum of query heads `heads` [QP] for `_combine_kernel`; returns their
    partial rows [QP] (where the split's unnormalized output goes)."""
    part = (b.to(tl.int64) * hq + heads) * num_splits + sp  # [QP]
    tl.store(pml_ptr + part * 2, m, mask=qmask)
    tl.store(pml_ptr + part * 2 + 1, l, mask=qmask)
    return part


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


@triton.jit
def _combine_kernel(
    po_ptr,
    pml_ptr,
    out_ptr,
    out_sb,
    out_sh,
    num_splits,
    HQ: tl.constexpr,
    D: tl.constexpr,
    SP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SP)
    ok = s < num_splits
    part = (b.to(tl.int64) * HQ + h) * num_splits + s
    ms = tl.load(pml_ptr + part * 2, mask=ok, other=float("-inf"))
    ls = tl.load(pml_ptr + part * 2 + 1, mask=ok, other=0.0)
    mx = tl.max(ms, 0)
    w = tl.where(ms > float("-inf"), tl.exp2(ms - mx), 0.0)  # empty splits weigh 0
    d = tl.arange(0, D)
    po = tl.load(po_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    o = tl.sum(po * w[:, None], 0) / tl.sum(ls * w, 0)
    tl.store(out_ptr + b.to(tl.int64) * out_sb + h * out_sh + d, o.to(out_ptr.dtype.element_ty))


def default_num_splits(batch: int, kv_heads: int, num_sms: int, split_mult: int = 2) -> int:
    """About `split_mult` waves of (sequence, head, split) programs; a function of the batch size only, so that
    one CUDA graph per batch size stays valid for every context length."""
    return max(1, min(32, math.ceil(split_mult * num_sms / max(1, batch * kv_heads))))


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
