"""What the paged decode-attention kernels share (int8: tile, fold2 and lean-loop kernels; fp8): each program's key
range of a split, the page walk from keys to pool rows, the two-group scale read, the online softmax step, the split
statistics and the kernel that merges the splits, and the split count.

Graph-safe: the grid depends only on the batch size and `num_splits`; each split's token range is computed on the
device from `seqlens` (a split past the end of a short sequence does nothing).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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
def _load_scale_pair(s_ptr, row, ok):
    """Both group scales of rows `row` [BLOCK] as fp32 [BLOCK] each, read as one 4-byte pair per row (one gather
    instead of two: scattered 2-byte loads cost L1 wavefronts like whole tile rows)."""
    pair = tl.load(s_ptr + row[:, None] * 2 + tl.arange(0, 2)[None, :], mask=ok[:, None], other=0.0)  # [BLOCK, 2]
    s0, s1 = tl.split(pair.to(tl.float32))
    return s0, s1


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
