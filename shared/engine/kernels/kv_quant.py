"""Group-wise int8 and fp8 (e4m3fn) quantize / dequantize of KV rows in Triton, bit-identical to `pdserve.kv.quant`
(the torch path): scales and zero points rounded to fp16 outward (scale up, zero down), IEEE division (`div_rn`),
round-half-to-even (int8: by the 1.5 * 2**23 trick; fp8: in integer ops, `fp8_e4m3_bits`), and
dequantization as (q [+ 128]) * s [+ z] in float32, whose products are exact.

Rows are the last dim (head_dim D, a power of two); a program handles BLOCK_R rows. Optional row indirection
(`slots`) lets the same code scatter into / gather from a paged pool: row r of the input is token r // H, head
r % H, stored at pool row slots[token] * H + head (slots < 0 are skipped: padded batch rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 32  # rows per program (quantize/dequantize): with 4 warps, the launch that keeps both near copy speed
NUM_WARPS = 4
FAST_DIV = True  # quantize: Markstein division (see _div), bit-equal to div_rn (the GPU kernel tests check it)


@triton.jit
def round_half_even(x):
    """Round to nearest, ties to even, for |x| < 2**22: adding 1.5 * 2**23 leaves no fraction bits."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def fp16_round_up(v):
    """Smallest fp16 >= v (v float32 in [0, 65504])."""
    h = v.to(tl.float16)
    up = (h.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) < v, up, h)


@triton.jit
def fp16_round_down(v):
    """Largest fp16 <= v (v float32 in [-65504, 65504])."""
    h = v.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    down = tl.where(bits < 0, bits + 1, bits - 1).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(h.to(tl.float32) > v, down, h)


@triton.jit
def fp8_e4m3_bits(y):
    """float32 y (|y| <= 448) -> the float8_e4m3fn bits [uint8] of y rounded to nearest, ties to even, with integer
    ops only (exact by construction, whatever a converter does with ties and subnormals): subnormals
    (|y| < 2**-6) count steps of 2**-9; normals keep 3 of fp32's 23 mantissa bits, the carry moving into the exponent
    as in IEEE rounding, then the exponent is re-biased (127 -> 7). The sign bit is y's (so -0.0 -> 0x80, as torch)."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    sub = round_half_even(a * 512.0).to(tl.int32)  # 0..8 (8 = 2**-6, the smallest normal's bits)
    ab = a.to(tl.int32, bitcast=True)
    rounded = (ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20  # [E32 | m3] after round-half-even
    normal = rounded - (120 << 3)  # E8 = E32 - 127 + 7
    mag = tl.where(a < 0.015625, sub, normal)
    return (mag | ((bits >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _div(a, b, FAST: tl.constexpr):
    """a / b rounded to nearest (IEEE). FAST: one correctly rounded reciprocal per group (b broadcasts), then
    q = a * r and one FMA correction q + (a - b q) r, which is the correctly rounded quotient when r = RN(1/b)
    and q is faithful (Markstein); three FMA-unit ops per element instead of a full division."""
    if FAST:
        r = tl.math.div_rn(tl.full(b.shape, 1.0, tl.float32), b)
        q = a * r
        return tl.fma(tl.fma(-q, b, a), r, q)
    return tl.math.div_rn(a, b)


@triton.jit
def quantize_tile(
    x, G: tl.constexpr, GS: tl.constexpr, ASYM: tl.constexpr, FAST: tl.constexpr = False, FP8: tl.constexpr = False
):
    """x float32 [R, G * GS] -> (q int8 [R, G*GS], scale fp16 [R, G], zero fp16 [R, G] (zeros if symmetric)).
    FP8 (symmetric only): q float8_e4m3fn, scale = absmax / 448 rounded up to fp16, q = RNE(x / scale)."""
    R: tl.constexpr = x.shape[0]
    g = tl.reshape(x, (R, G, GS))
    lo = tl.min(g, axis=2)
    hi = tl.max(g, axis=2)
    if FP8:
        absmax = tl.maximum(hi, -lo)
        scale = fp16_round_up(tl.minimum(tl.math.div_rn(absmax, 448.0), 65504.0))
        scale = tl.where(scale == 0, 1.0, scale.to(tl.float32)).to(tl.float16)
        zero = tl.zeros_like(scale)
        y = _div(g, scale.to(tl.float32)[:, :, None], FAST)
        q = tl.minimum(tl.maximum(y, -448.0), 448.0)  # |y| <= 448 already; the conversion saturates anyway
    elif ASYM:
        zero = fp16_round_down(tl.minimum(tl.maximum(lo, -65504.0), 65504.0))
        zf = zero.to(tl.float32)
        scale = fp16_round_up(tl.minimum(tl.math.div_rn(hi - zf, 255.0), 65504.0))
        scale = tl.where(scale == 0, 1.0, scale.to(tl.float32)).to(tl.float16)
        y = _div(g - zf[:, :, None], scale.to(tl.float32)[:, :, None], FAST)
        q = tl.minimum(tl.maximum(round_half_even(y), 0.0), 255.0) - 128.0
    else:
        absmax = tl.maximum(hi, -lo)
        scale = fp16_round_up(tl.minimum(tl.math.div_rn(absmax, 127.0), 65504.0))
        scale = tl.where(scale == 0, 1.0, scale.to(tl.float32)).to(tl.float16)
        zero = tl.zeros_like(scale)
        y = _div(g, scale.to(tl.float32)[:, :, None], FAST)
        q = tl.minimum(tl.maximum(round_half_even(y), -127.0), 127.0)
    q = tl.reshape(q, (R, G * GS))
    if FP8:
        out = fp8_e4m3_bits(q).to(tl.float8e4nv, bitcast=True)
    else:
        out = q.to(tl.int8)
    return out, scale, zero


@triton.jit
def dequantize_tile(q, s, z, G: tl.constexpr, GS: tl.constexpr, ASYM: tl.constexpr):
    """q int8 | fp8 [R, G*GS], s/z fp16 [R, G] -> float32 [R, G*GS]: q*s, or (z + 128 s) + q*s (products exact)."""
    R: tl.constexpr = q.shape[0]
    qf = tl.reshape(q.to(tl.float32), (R, G, GS))
    sf = s.to(tl.float32)[:, :, None]
    if ASYM:
        x = (z.to(tl.float32)[:, :, None] + 128.0 * sf) + qf * sf
    else:
        x = qf * sf
    return tl.reshape(x, (R, G * GS))


@triton.jit
def _quantize_kernel(
    x_ptr,
    x_stride,
    q_ptr,
    s_ptr,
    z_ptr,
    slot_ptr,
    n_rows,
    H,
    D: tl.constexpr,
    G: tl.constexpr,
    ASYM: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
    FAST: tl.constexpr,
    FP8: tl.constexpr,
):
    """x rows [n_rows, D] (row r at x_ptr + (r // H) * x_stride + (r % H) * D) -> pool rows (see module doc)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    gi = tl.arange(0, G)
    ok = rows < n_rows
    tok = rows // H
    head = rows % H
    src = tok.to(tl.int64) * x_stride + head * D
    x = tl.load(x_ptr + src[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + tok, mask=ok, other=-1)
        ok = ok & (slot >= 0)
        dst = slot.to(tl.int64) * H + head
    else:
        dst = rows.to(tl.int64)
    q, s, z = quantize_tile(x, G, D // G, ASYM, FAST, FP8)
    tl.store(q_ptr + dst[:, None] * D + d[None, :], q, mask=ok[:, None])
    tl.store(s_ptr + dst[:, None] * G + gi[None, :], s, mask=ok[:, None])
    if ASYM:
        tl.store(z_ptr + dst[:, None] * G + gi[None, :], z, mask=ok[:, None])


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, z_ptr, out_ptr, n_rows, D: tl.constexpr, G: tl.constexpr, ASYM: tl.constexpr, BLOCK: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    gi = tl.arange(0, G)
    ok = rows < n_rows
    r = rows.to(tl.int64)
    q = tl.load(q_ptr + r[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)  # 0.0: no int 0 -> fp8 cast
    s = tl.load(s_ptr + r[:, None] * G + gi[None, :], mask=ok[:, None], other=1.0)
    z = s
    if ASYM:
        z = tl.load(z_ptr + r[:, None] * G + gi[None, :], mask=ok[:, None], other=0.0)
    x = dequantize_tile(q, s, z, G, D // G, ASYM)
    tl.store(out_ptr + r[:, None] * D + d[None, :], x.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def supported(head_dim: int, group_size: int) -> bool:
    """The kernels need power-of-two head_dim and group size (tl.arange); other shapes use the torch path."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return pow2(head_dim) and pow2(group_size) and group_size <= head_dim and head_dim >= 16


def quantize(
    x: torch.Tensor,
    group_size: int,
    asymmetric: bool,
    block_rows: int = BLOCK_R,
    num_warps: int = NUM_WARPS,
    fast_div: bool = FAST_DIV,
    fp8: bool = False,
):
    """x [..., D] float -> q int8 (float8_e4m3fn if `fp8`, symmetric only) [..., D], scales fp16 [..., D/g],
    zeros fp16 [..., D/g] | None."""
    assert not (fp8 and asymmetric), "fp8 KV is symmetric only"
    d = x.shape[-1]
    xc = x.contiguous()
    n = xc.numel() // d
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else torch.int8, device=x.device)
    s = torch.empty(*x.shape[:-1], d // group_size, dtype=torch.float16, device=x.device)
    z = torch.empty_like(s) if asymmetric else None
    if n:
        _quantize_kernel[(triton.cdiv(n, block_rows),)](
            xc,
            d,
            q,
            s,
            z if asymmetric else s,
            s,
            n,
            1,
            D=d,
            G=d // group_size,
            ASYM=asymmetric,
            HAS_SLOTS=False,
            BLOCK=block_rows,
            FAST=fast_div,
            FP8=fp8,
            num_warps=num_warps,
        )
    return q, s, z


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype,
    block_rows: int = BLOCK_R,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    d = q.shape[-1]
    qc, sc = q.contiguous(), scales.contiguous()
    zc = zeros.contiguous() if zeros is not None else sc
    n = qc.numel() // d
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if n:
        _dequantize_kernel[(triton.cdiv(n, block_rows),)](
            qc, sc, zc, out, n, D=d, G=d // group_size, ASYM=zeros is not None, BLOCK=block_rows, num_warps=num_warps
        )
    return out
