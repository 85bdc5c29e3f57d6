"""Rotary embedding (rotate-half) applied in place to q and k, fused with the write of k and v into the paged
KV pool (dense: a cast; int8 or fp8 e4m3fn: group-wise quantization with the numerics of pdserve.kv.quant, from k/v
rounded to the activation dtype, exactly as the unfused path quantizes them). One program per token; tokens whose slot
is < 0 (padded rows of a CUDA-graph batch) are rotated but not written.

cos/sin come from a float32 table [max_positions, D/2] built once (`RotaryEmbedding`), the same values HF
computes per step (positions * inv_freq in float32)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pdserve.engine.kernels.kv_quant import quantize_tile


@triton.jit
def _rotate(ptr, rows, j, HALF: tl.constexpr, cos, sin, mask):
    """Load rows [R] x [D] at ptr (row offsets `rows`), rotate, store back; return the rotated row [R, D] as
    float32 (after rounding to the stored dtype)."""
    p1 = ptr + rows[:, None] + j[None, :]
    x1 = tl.load(p1, mask=mask[:, None], other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask[:, None], other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (f1 * cos[None, :] - f2 * sin[None, :]).to(x1.dtype)
    o2 = (f2 * cos[None, :] + f1 * sin[None, :]).to(x1.dtype)
    tl.store(p1, o1, mask=mask[:, None])
    tl.store(p1 + HALF, o2, mask=mask[:, None])
    return o1, o2


@triton.jit
def _rope_kv_write_kernel(
    pos_ptr,
    q_ptr,
    q_st,
    k_ptr,
    k_st,
    v_ptr,
    v_st,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    kz_ptr,
    vz_ptr,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HP: tl.constexpr,
    D: tl.constexpr,
    INT8: tl.constexpr,
    G: tl.constexpr,
    ASYM: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: wait for the previous kernel's writes, let the next launch
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    pos = tl.load(pos_ptr + t)
    j = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * HALF + j)
    sin = tl.load(sin_ptr + pos * HALF + j)
    hq = tl.arange(0, HP)
    _rotate(q_ptr + t * q_st, hq * D, j, HALF, cos, sin, hq < H)
    hk = tl.arange(0, KVH)
    k1, k2 = _rotate(k_ptr + t * k_st, hk * D, j, HALF, cos, sin, hk < KVH)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        d = tl.arange(0, D)
        k = tl.reshape(tl.permute(tl.join(k1, k2), (0, 2, 1)), (KVH, D))  # [KVH, D] = [k1 | k2]
        v = tl.load(v_ptr + t * v_st + hk[:, None] * D + d[None, :])
        row = slot.to(tl.int64) * KVH + hk  # [KVH] pool rows
        if INT8:  # a quantized pool: int8, or fp8 (FP8)
            gi = tl.arange(0, G)
            kq, ks, kz = quantize_tile(k.to(tl.float32), G, D // G, ASYM, False, FP8)
            vq, vs, vz = quantize_tile(v.to(tl.float32), G, D // G, ASYM, False, FP8)
            tl.store(kc_ptr + row[:, None] * D + d[None, :], kq)
            tl.store(vc_ptr + row[:, None] * D + d[None, :], vq)
            tl.store(ks_ptr + row[:, None] * G + gi[None, :], ks)
            tl.store(vs_ptr + row[:, None] * G + gi[None, :], vs)
            if ASYM:
                tl.store(kz_ptr + row[:, None] * G + gi[None, :], kz)
                tl.store(vz_ptr + row[:, None] * G + gi[None, :], vz)
        else:
            tl.store(kc_ptr + row[:, None] * D + d[None, :], k.to(kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + row[:, None] * D + d[None, :], v.to(vc_ptr.dtype.element_ty))


def rope_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    pool: tuple,
    pdl: bool = False,
) -> None:
    """positions [T] (int), q [T, H, D], k/v [T, KVH, D] (heads contiguous, any token stride): q, k rotated in
    place; k, v written at `slots` [T] of `pool`: (k [P, ps, KVH, D], v) dense, or
    (k, v, k_scales, v_scales, k_zeros | None, v_zeros | None) for a quantized pool (k, v int8 or float8_e4m3fn)."""
    t, h, d = q.shape
    kvh = k.shape[1]
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.stride(1) == d
    int8 = len(pool) == 6
    if int8:
        kc, vc, ks, vs, kz, vz = pool
        asym = kz is not None
        g = ks.shape[-1]
        kz, vz = (kz, vz) if asym else (ks, vs)
    else:
        kc, vc = pool
        ks = vs = kz = vz = kc
        g, asym = 1, False
    if t:
        _rope_kv_write_kernel[(t,)](
            positions,
            q,
            q.stride(0),
            k,
            k.stride(0),
            v,
            v.stride(0),
            cos,
            sin,
            slots,
            kc,
            vc,
            ks,
            vs,
            kz,
            vz,
            H=h,
            KVH=kvh,
            HP=triton.next_power_of_2(h),
            D=d,
            INT8=int8,
            G=g,
            ASYM=asym,
            FP8=kc.dtype == torch.float8_e4m3fn,
            USE_PDL=pdl,
            num_warps=4,
            **(dict(launch_pdl=True) if pdl else {}),
        )
