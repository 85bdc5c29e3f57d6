"""Triton kernel: FP8 e4m3 activation quantization per token (one group = the row) or per token per group of
columns (block-scaled GEMMs), one program per (row, group); launched by `fp8_quant.quantize_activations`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, SPAN: tl.constexpr, BLOCK: tl.constexpr, AMAX_MIN):
    """Program (row, group): amax over the group's SPAN columns, then q = x / (amax / 448) as e4m3."""
    row, grp = tl.program_id(0), tl.program_id(1)
    start = grp * SPAN
    x_row = x_ptr + row.to(tl.int64) * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, SPAN, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        m = (cols < K) & (off + tl.arange(0, BLOCK) < SPAN)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), AMAX_MIN) / 448.0
    tl.store(s_ptr + row * tl.num_programs(1) + grp, scale)
    q_row = q_ptr + row.to(tl.int64) * K
    for off in range(0, SPAN, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        m = (cols < K) & (off + tl.arange(0, BLOCK) < SPAN)
        x = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=m)
