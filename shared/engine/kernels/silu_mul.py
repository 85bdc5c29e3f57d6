"""SwiGLU activation: gate_up [T, 2I] (gate | up, as the fused gate_up projection writes it) -> silu(gate) * up
[T, I], rounding like `F.silu(gate) * up` in the activation dtype (silu rounded, then the product).

`silu_mul_fp8`: the same product quantized to e4m3 per row for a per-channel FP8 down projection (scale =
amax(|out|) / 448 of the rounded product, the math of quant/fp8_quant.quantize_activations): a program computes a
row's amax over its I columns, then recomputes each block and writes it in e4m3. The programs are few (a few per
SM, each looping over rows) so that the rows in flight fit in L2 (a row is 4I bytes, 112 KiB for the 8B shape):
the second read of a row hits L2, and HBM sees one read of gate_up and one byte a value written, against a [T, I]
activation-dtype write and one or two reads of it for a separate quantization pass. Rows of at most ROW_BLOCK_MAX
columns (every Llama / Qwen FFN up to I = 16384) take `_silu_mul_fp8_row_kernel` instead: one program a row, the
row's products held in registers between the amax and the cast, so gate_up is read once with no second pass at
all (the choice: `single_pass`, timed against the loop in tests/shared/engine/test_engine_gpu_fp8_fusion.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK = 1024
FP8_BLOCK = 4096  # columns a step of the FP8 kernel's row loop
ROW_BLOCK_MAX = 16384  # widest row (padded to a power of 2) the single-pass FP8 kernel holds in registers
L2_ROWS_BYTES = 24 << 20  # gate_up bytes of the rows the FP8 kernel's programs hold at once (H100/H200 L2: 50 MB)
FP8 = torch.float8_e4m3fn
AMAX_FLOOR = 1e-12  # = quant/fp8_quant.AMAX_FLOOR


@triton.jit
def _silu_mul_kernel(x_ptr, x_stride, out_ptr, out_stride, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: wait for the previous kernel's writes, let the next launch
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    g = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    u = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (a * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_block(x_row, n_cols, cols, m):
    """silu(gate) * up of one block of a row, rounded to the activation dtype as `_silu_mul_kernel` does, in fp32
    (masked columns 0)."""
    g = tl.load(x_row + cols, mask=m, other=0.0)
    u = tl.load(x_row + n_cols + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    return (a * u.to(tl.float32)).to(g.dtype).to(tl.float32)


@triton.jit
def _silu_mul_fp8_kernel(
    x_ptr, x_stride, q_ptr, q_stride, scale_ptr, n_rows, n_cols, amax_floor, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    while row < n_rows:  # rows pid, pid + programs, ...
        x_row = x_ptr + row * x_stride
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for off in range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_swiglu_block(x_row, n_cols, cols, cols < n_cols)))
        scale = tl.maximum(tl.max(amax, axis=0), amax_floor) / 448.0
        for off in range(0, n_cols, BLOCK):  # the row again, from L2
            cols = off + tl.arange(0, BLOCK)
            m = cols < n_cols
            y = _swiglu_block(x_row, n_cols, cols, m)
            q = tl.clamp(y / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + row * q_stride + cols, q, mask=m)
        tl.store(scale_ptr + row, scale)
        row += tl.num_programs(0)


@triton.jit
def _silu_mul_fp8_row_kernel(
    x_ptr, x_stride, q_ptr, q_stride, scale_ptr, n_cols, amax_floor, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):  # fmt: skip
    """One row a program, in one pass: the row's products stay in registers from the amax to the e4m3 cast (the
    same math as `_silu_mul_fp8_kernel`, so the same bytes)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    y = _swiglu_block(x_ptr + row * x_stride, n_cols, cols, m)  # [BLOCK] fp32, masked columns 0
    scale = tl.maximum(tl.max(tl.abs(y), axis=0), amax_floor) / 448.0
    q = tl.clamp(y / scale, -448.0, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * q_stride + cols, q, mask=m)
    tl.store(scale_ptr + row, scale)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    t, n2 = gate_up.shape
    n = n2 // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_kernel[(t, triton.cdiv(n, BLOCK))](
        gate_up,
        gate_up.stride(0),
        out,
        out.stride(0),
        n,
        BLOCK=BLOCK,
        USE_PDL=pdl,
        num_warps=4,
        **(dict(launch_pdl=True) if pdl else {}),
    )
    return out


def single_pass_fits(cols: int) -> bool:
    """Whether `silu_mul_fp8` of I = `cols` takes the single-pass kernel (the row held in registers)."""
    return triton.next_power_of_2(max(cols, 1)) <= ROW_BLOCK_MAX


def fp8_programs(rows: int, cols: int, device: torch.device) -> int:
    """Programs of `silu_mul_fp8` for `rows` rows of I = `cols`: as many as keep L2_ROWS_BYTES of rows in flight,
    between one and four per SM (fewer starve the memory system of loads), never more than the rows."""
    if device.type != "cuda":  # Triton's interpreter (tests)
        return max(1, min(rows, 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(rows, 4 * sms, max(sms, L2_ROWS_BYTES // (4 * cols))))


def silu_mul_fp8(
    gate_up: torch.Tensor, pdl: bool = False, programs: int | None = None, single_pass: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [T, 2I] -> (q [T, I] e4m3, scale [T, 1] float32): q * scale ≈ silu_mul(gate_up) (`_scaled_mm`'s
    rowwise scale_a layout). `single_pass`: one program a row with the row in registers (None: where I fits
    ROW_BLOCK_MAX); else the row loop over `programs` programs (default `fp8_programs`)."""
    t, n2 = gate_up.shape
    n = n2 // 2
    assert gate_up.stride(1) == 1
    q = torch.empty(t, n, dtype=FP8, device=gate_up.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=gate_up.device)
    row_block = triton.next_power_of_2(max(n, 1))
    if single_pass is None:
        single_pass = programs is None and single_pass_fits(n)
    if t and single_pass:
        assert row_block <= ROW_BLOCK_MAX, f"a row of {n} columns does not fit the single-pass kernel"
        _silu_mul_fp8_row_kernel[(t,)](
            gate_up,
            gate_up.stride(0),
            q,
            q.stride(0),
            scale,
            n,
            AMAX_FLOOR,
            BLOCK=row_block,
            USE_PDL=pdl,
            num_warps=max(4, min(16, row_block // 1024)),
            **(dict(launch_pdl=True) if pdl else {}),
        )
    elif t:
        block = min(FP8_BLOCK, triton.next_power_of_2(n))
        _silu_mul_fp8_kernel[(programs or fp8_programs(t, n, gate_up.device),)](
            gate_up,
            gate_up.stride(0),
            q,
            q.stride(0),
            scale,
            t,
            n,
            AMAX_FLOOR,
            BLOCK=block,
            USE_PDL=pdl,
            num_warps=8 if block >= 2048 else 4,
            **(dict(launch_pdl=True) if pdl else {}),
        )
    return q, scale
