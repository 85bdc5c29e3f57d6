"""Triton kernel: FP8 e4m3 activation quantization per token (one group = the row) or per token per group of
columns (block-scaled GEMMs), one program per (row, group): the group's amax, its scale and the e4m3 cast in one
launch; launched by `fp8_quant.quantize_activations`. A group of at most BLOCK columns (every 8B / 70B row up to
8192 columns, every 128-column group) is read once and kept in registers; longer ones are read twice."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def act_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_x, AMAX_MIN, SPAN: tl.constexpr, BLOCK: tl.constexpr,
    COL_MAJOR: tl.constexpr,
):  # fmt: skip
    """Program (row, group): amax over the group's SPAN columns, then q = x / (amax / 448) as e4m3; the scale at
    [row, group] of a row-major [M, G] tensor, or (COL_MAJOR) of a column-major one (stored [G, M])."""
    row, grp = tl.program_id(0), tl.program_id(1)
    start = grp * SPAN
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * K
    if SPAN <= BLOCK:  # one pass: the group stays in registers
        cols = start + tl.arange(0, BLOCK)
        m = (cols < K) & (tl.arange(0, BLOCK) < SPAN)
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), AMAX_MIN) / 448.0
        tl.store(q_row + cols, tl.clamp(x / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=m)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, SPAN, BLOCK):
            cols = start + off + tl.arange(0, BLOCK)
            m = (cols < K) & (off + tl.arange(0, BLOCK) < SPAN)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), AMAX_MIN) / 448.0
        for off in range(0, SPAN, BLOCK):
            cols = start + off + tl.arange(0, BLOCK)
            m = (cols < K) & (off + tl.arange(0, BLOCK) < SPAN)
            x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(q_row + cols, tl.clamp(x / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=m)
    if COL_MAJOR:
        tl.store(s_ptr + grp * M + row, scale)
    else:
        tl.store(s_ptr + row * tl.num_programs(1) + grp, scale)
