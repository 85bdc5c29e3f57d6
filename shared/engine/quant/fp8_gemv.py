"""Triton kernels: y = x @ (W * scale)^T (+ b) over e4m3 weights for decode-sized batches (M <= MAX_M tokens).

Weight-only dequantization: the activations stay in their dtype (bf16 in the engine; no activation quantizer
launch) and the work is reading the weight bytes, so the kernels keep many of them in flight. Each program owns
BLOCK_N output channels and a contiguous run of K; each step loads a [BLOCK_N, BLOCK_K] e4m3 tile (BLOCK_K a
power-of-2 multiple of the 128-column scale group) and multiplies it in one of four ways (`choose_path`):
- path "stream" (M <= AUTO_STREAM_ROWS under "auto"): the bf16 GEMV's shape (kernels/gemv.py) over e4m3 bytes, on
  the CUDA cores in float32. The tile is loaded as plain rows, W_VEC bytes a thread (so x's bf16 columns land in
  the same threads without a shared-memory exchange), each thread sums its runs of W_VEC products in registers
  (where a block scale applies), and the next tile's loads are issued before this tile's math (`prefetch`). The
  run sums join the output sum each step, or with `acc_k` stay elementwise until after the K loop: then
  the loop has no cross-thread traffic at all. The products are float32 (e4m3 widened by the conversion
  instructions, or with `bits` by integer ops), or with `half` packed float16 (RUN_F16_ASM: fewer instructions);
- path "fma" (M <= FMA_MAX_ROWS; "auto" does not take it: AUTO_FMA_ROWS): on the CUDA cores in float32, the tile
  viewed as [BLOCK_N, BLOCK_K / 128, 128] so that each 128-column group's partial sum meets its own block scale;
- path "dot" (larger M under "auto"): one 128-column group per step on the tensor cores (e4m3 -> activation dtype
  is exact, fp32 sum);
- path "tc" (16-bit x only; "auto" does not take it, see AUTO_STREAM_ROWS): "dot" with the operands swapped (the weight
  tile as the MMA's rows, x's rows padded to 16 as its columns: Hopper's wgmma wants 64 rows) and in float16:
  e4m3 -> float16 is one conversion per two weights (bf16 needs integer ops), and each step scales its x columns
  per row by a power of two that float16 holds exactly (`_x_f16`), undone on the step's fp32 partial sums.
Scales: per channel (scale [N]) once per program at the end ("tc": each step); per 128x128 block (scale
[ceil(N/128), ceil(K/128)]) or per row per 128 columns (`scale_rows=1`) per group, before the group's sum joins
the accumulator.
bench/fp8_gemv_sweep.py times every path and PATH_CONFIGS entry (the defaults and AUTO_* come from it).

Split-K (`split` programs along K, where the output channels alone give too few programs): each program writes
its float32 partial sums, then takes a ticket from its column tile's counter; the program that takes the last
ticket adds the partials up in a fixed order (deterministic), adds the bias, writes y and resets the counter to 0.
One launch either way (no second reduction kernel). The counters ([column tiles] int32, zero between calls) come
from the caller (`Fp8Linear` keeps one buffer), else a zeroed tensor per call.

`pdl=True` (Hopper, programmatic dependent launch; kernels/gemv.py): each program loads its first weight tile
before it waits for the kernel that wrote x, hiding launch latency and the weight stream's ramp-up behind the
previous kernel's tail. No host sync anywhere (the split comes from shapes and the SM count): capturable in the
decode CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MAX_M = 16  # rows one program multiplies (the tensor-core tile's M); Fp8Linear routes larger batches elsewhere
FMA_MAX_ROWS = 4  # the CUDA-core path "fma" takes at most this many rows
STREAM_MAX_ROWS = 16  # the CUDA-core path "stream" (its products per row grow with M; "auto" stops far earlier)
# "auto": the streaming CUDA-core path up to AUTO_STREAM_ROWS rows (plain row loads, no per-step tensor-core tile
# of 16 mostly masked rows, no shared memory; its float32 products cost ~M + 2 instructions a weight byte,
# which the CUDA cores keep up with at copy bandwidth only for a few rows), then "fma" up to AUTO_FMA_ROWS (0:
# never: it keeps fewer bytes in flight than either), then the tensor cores ("dot")
AUTO_STREAM_ROWS = 1  # the sweep: "stream" is fastest at M = 1 (8B layer 2.83 TB/s vs dot 2.26), "dot" from M = 2
# (H200). "tc" is not "auto"'s: where the sweep's layer graphs favoured it over "dot", the engine's decode step did
# not move, and at M = 1 "stream" stays ahead of both (docs/benchmarks.md has the figures)
AUTO_FMA_ROWS = 0
GROUP = 128  # columns of one block-scale group
K_GROUP = tl.constexpr(GROUP)  # the same, as kernels read globals
# "stream": weight bytes a thread loads as one vector; 8 bf16 of x are also 16 bytes, so x's columns land in the
# threads that hold the same weight columns (16 would move x through shared memory, with barriers, every step)
W_VEC = tl.constexpr(8)
# "stream" with `bits`: e4m3 bytes widened to float32 by integer ops (`_e4m3_bits`, 2**-E4M3_BITS_SHIFT times the
# value: float32's exponent bias less e4m3's) instead of the conversion instructions (two a byte: e4m3 -> f16 -> f32),
# for where those, not the weight stream, pace the kernel (the sweep says). x's columns are scaled by 2**X_SHIFT
# first so that no product is subnormal (|x| < 2**64 holds for any activation), and the sums by
# 2**(E4M3_BITS_SHIFT - X_SHIFT) at the end: powers of two, so the result is bit for bit the conversion path's
E4M3_BITS_SHIFT, X_SHIFT = 120, 64
X_SCALE = tl.constexpr(2.0**X_SHIFT)
OUT_SCALE = tl.constexpr(2.0 ** (E4M3_BITS_SHIFT - X_SHIFT))
MIN_BLOCK_N = 4  # the fewest output channels a program takes (counter_slots sizes the split-K tickets by it)
FMA_WARP_ELEMENTS = 2048  # most BLOCK_M x BLOCK_N x BLOCK_K of the "fma" product a step, per warp (64 a thread)
# "stream": most weight bytes a thread loads a step (BLOCK_N x BLOCK_K / threads, at any M): with the prefetch the
# raw tile is held twice next to its float32 products, so past 64 the registers spill (ptxas, sm_90)
STREAM_THREAD_ELEMENTS = 64
STREAM_THREAD_ELEMENTS_NO_PREFETCH = 128
STREAM_ACC_THREAD_ELEMENTS = 32  # acc_k's float32 run sums a thread (BLOCK_M x BLOCK_N x BLOCK_K / 8 / threads)
# per path: BLOCK_N output channels a program, BLOCK_K columns a step (CUDA cores: capped by the budgets above),
# launch; programs_per_sm: the grid the split aims at (H200: 132 SMs)
DEFAULT_FMA = dict(block_n=16, block_k=512, num_warps=4, num_stages=3, programs_per_sm=4)
DEFAULT_DOT = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4)
# "stream": its K loop software-pipelined 3 deep keeps more weight bytes in flight, and its products in packed
# float16 (`half`: fewer instructions a weight byte, RUN_F16_ASM) where x is 16-bit on a device; the sweep's
# fastest config across the 8B and 70B shapes (docs/benchmarks.md, "FP8 weights")
DEFAULT_STREAM = dict(block_n=8, block_k=2048, num_warps=8, num_stages=3, programs_per_sm=4, acc_k=True, prefetch=False,
                      half=True)  # fmt: skip
# "tc": as "dot", the MMA's operands swapped (the weight tile its rows) and in float16 (`_x_f16`)
DEFAULT_TC = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4)
DEFAULTS = {"stream": DEFAULT_STREAM, "fma": DEFAULT_FMA, "dot": DEFAULT_DOT, "tc": DEFAULT_TC}
# (path, M rounded up to a power of 2, N, K) -> launch config for a known decode shape, taken before DEFAULTS[path]
# (bench/fp8_gemv_sweep.py prints this table from its best configs)
# the fastest launch per decode shape as bench/fp8_gemv_sweep.py prints it (Hopper); "stream" at M = 1 takes
# DEFAULT_STREAM at every shape, M = 16 is left to the defaults
SHAPE_CONFIGS: dict[tuple[str, int, int, int], dict] = {
    ('dot', 2, 4096, 4096): dict(block_n=32, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4),
    ('dot', 2, 4096, 14336): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 2, 6144, 4096): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 2, 8192, 8192): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 2, 8192, 28672): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 2, 10240, 8192): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 2, 28672, 4096): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 2, 57344, 8192): dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4),
    ('dot', 4, 4096, 4096): dict(block_n=32, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4),
    ('dot', 4, 4096, 14336): dict(block_n=32, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4),
    ('dot', 4, 6144, 4096): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 4, 8192, 8192): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 4, 8192, 28672): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 4, 10240, 8192): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 4, 28672, 4096): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 4, 57344, 8192): dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4),
    ('dot', 8, 4096, 4096): dict(block_n=32, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4),
    ('dot', 8, 4096, 14336): dict(block_n=32, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4),
    ('dot', 8, 6144, 4096): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 8, 8192, 8192): dict(block_n=32, block_k=128, num_warps=4, num_stages=6, programs_per_sm=8),
    ('dot', 8, 8192, 28672): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 8, 10240, 8192): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 8, 28672, 4096): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('dot', 8, 57344, 8192): dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4),
    # "tc": an H100's sweep (bench/fp8_gemv_sweep.py --paths stream,tc,dot --ms 1,2,4,16 --scales channel)
    ('tc', 4, 6144, 4096): dict(block_n=128, block_k=128, num_warps=8, num_stages=4, programs_per_sm=2),
    ('tc', 4, 10240, 8192): dict(block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=8),
    ('tc', 16, 10240, 8192): dict(block_n=128, block_k=128, num_warps=8, num_stages=4, programs_per_sm=2),
}  # fmt: skip
# the configurations bench/fp8_weights.py times at M = 1 (the last: the tensor-core path, the first version's)
SWEEP_CONFIGS = [
    dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, programs_per_sm=pps, half=False)
    for bn, bk, nw, ns, pps in [
        (8, 1024, 4, 3, 4), (16, 1024, 4, 2, 4), (32, 256, 4, 3, 4), (16, 2048, 8, 2, 2), (8, 512, 2, 3, 8),
        (64, 128, 4, 4, 4),
    ]
] + [dict(path="dot", **DEFAULT_DOT)]  # fmt: skip
# per path: the launch configs bench/fp8_gemv_sweep.py times at every M (the first: the default), and the most rows
PATH_CONFIGS = {
    "stream": [DEFAULT_STREAM] + [
        dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=1, programs_per_sm=pps, acc_k=acc, prefetch=pre,
             half=False)
        for bn, bk, nw, pps, acc, pre in [
            (4, 2048, 4, 4, True, True), (8, 2048, 8, 4, True, True), (16, 512, 4, 4, True, True),
            (4, 1024, 2, 4, True, True), (16, 1024, 8, 2, True, True),
            (8, 1024, 4, 4, False, True), (4, 2048, 4, 4, False, True), (16, 512, 4, 4, False, True),
            (8, 2048, 8, 4, False, True), (16, 1024, 8, 4, False, True), (8, 512, 2, 4, False, True),
            (32, 512, 8, 4, False, True), (8, 2048, 4, 4, True, False), (8, 2048, 4, 4, False, False),
            (16, 1024, 4, 2, False, False), (16, 2048, 8, 2, True, False),
        ]
    ] + [  # pipelined K loops (num_stages > 1)
        dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, programs_per_sm=pps, acc_k=True, prefetch=False,
             half=False)
        for bn, bk, nw, ns, pps in [(8, 1024, 4, 2, 4), (8, 1024, 4, 4, 4), (8, 512, 4, 3, 4), (16, 512, 4, 3, 4),
                                    (8, 1024, 4, 3, 8), (8, 2048, 8, 3, 4), (16, 1024, 8, 3, 4), (4, 2048, 4, 3, 4),
                                    (8, 1024, 4, 3, 2), (8, 1024, 4, 5, 4), (16, 1024, 8, 4, 2), (8, 2048, 8, 2, 4),
                                    (4, 1024, 2, 4, 8)]
    ] + [  # products in packed float16 (`half`: RUN_F16_ASM), fewer registers, so also larger tiles
        dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, programs_per_sm=pps, acc_k=True, prefetch=False,
             half=True)
        for bn, bk, nw, ns, pps in [(8, 1024, 4, 3, 4), (8, 2048, 8, 3, 4), (16, 1024, 8, 3, 4), (8, 1024, 4, 4, 4),
                                    (8, 1024, 4, 3, 8), (16, 1024, 4, 3, 4), (8, 2048, 4, 3, 4)]
    ] + [  # the same widened by integer ops (`bits`)
        dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, programs_per_sm=pps, acc_k=True, prefetch=False,
             bits=True)
        for bn, bk, nw, ns, pps in [(8, 1024, 4, 3, 4), (8, 2048, 8, 3, 4), (16, 1024, 8, 3, 4), (8, 1024, 4, 4, 4),
                                    (8, 1024, 4, 3, 8)]
    ],
    "dot": [DEFAULT_DOT] + [
        dict(block_n=bn, block_k=GROUP, num_warps=nw, num_stages=ns, programs_per_sm=pps)
        for bn, nw, ns, pps in [(32, 4, 4, 4), (128, 4, 4, 4), (64, 8, 4, 4), (64, 4, 6, 4), (32, 4, 6, 8),
                                (128, 8, 3, 2), (16, 4, 4, 8), (64, 4, 3, 8), (128, 8, 6, 4), (256, 8, 4, 2)]
    ],
    "fma": [DEFAULT_FMA] + [{k: v for k, v in c.items() if k != "path"} for c in SWEEP_CONFIGS[:-2]],
    "tc": [DEFAULT_TC] + [
        dict(block_n=bn, block_k=GROUP, num_warps=nw, num_stages=ns, programs_per_sm=pps)
        for bn, nw, ns, pps in [(64, 4, 3, 8), (64, 4, 6, 4), (128, 4, 4, 4), (128, 8, 4, 2), (128, 4, 6, 2),
                                (64, 8, 4, 4), (256, 8, 3, 2), (64, 4, 8, 4)]
    ],
}  # fmt: skip
PATH_MAX_ROWS = {"stream": STREAM_MAX_ROWS, "fma": FMA_MAX_ROWS, "dot": MAX_M, "tc": MAX_M}


@triton.jit
def _w_tile(w_rows, n_ok, st, K, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Step `st`'s weight tile, e4m3: [BLOCK_N, BLOCK_K / 128, 128] (CUDA cores) or [BLOCK_N, 128] (DOT)."""
    # one return after a constexpr if/else: Triton's compiler (unlike its interpreter) types every return it
    # reaches, and a return inside `if DOT:` does not end code generation of the lines after it
    if DOT:
        k = st * K_GROUP + tl.arange(0, K_GROUP)
        tile = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
    else:
        g = st * (BLOCK_K // K_GROUP) + tl.arange(0, BLOCK_K // K_GROUP)
        kg = g[:, None] * K_GROUP + tl.arange(0, K_GROUP)[None, :]  # [G, 128]
        tile = tl.load(w_rows[:, :, None] + kg[None, :, :], mask=n_ok[:, None, None] & (kg[None, :, :] < K), other=0.0)
    return tile


@triton.jit
def _x_f16(x):
    """x [BLOCK_M, 128] (float32 values of 16-bit activations) -> (x * 2**e as float16, 2**-e [BLOCK_M]) with e per
    row putting its largest |x| in [2**13, 2**14): float16 then holds every column exactly (bf16's 8 significant
    bits fit float16's 11 down to 2**-27 of that largest one; nothing reaches 65504) and the tensor cores multiply
    it by e4m3 (exact in float16) with float32 sums. e from the float32 exponent bits: exact, no log2."""
    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_M]
    exp = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)) (amax normal)
    # at most 2**126 either way (both factors normal float32): rows below 2**-113 come up part of the way
    e = tl.minimum(tl.maximum(tl.where(amax > 0, 13 - exp, 0), -126), 126)
    up = ((127 + e) << 23).to(tl.float32, bitcast=True)  # 2**e
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e
    return (x * up[:, None]).to(tl.float16), down


@triton.jit
def _step(acc, w, x_ptr, s_ptr, m, n, n_ok, M, K, KG, x_stride, st, SBN: tl.constexpr, PER_CHANNEL: tl.constexpr,
          FP32: tl.constexpr, DOT: tl.constexpr, TC: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] ([BLOCK_N, BLOCK_M] with TC) += x's step `st` columns times the weight tile `w` (block
    scales applied)."""
    if TC:  # weights as the MMA's rows (M >= 64 for Hopper's wgmma), x's rows padded to 16 as its columns
        k = st * K_GROUP + tl.arange(0, K_GROUP)
        x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        x16, down = _x_f16(x.to(tl.float32))
        part = tl.dot(w.to(tl.float16), tl.trans(x16))  # [BLOCK_N, BLOCK_M], |part| < 2**14 * 448 * 128
        # the weight scale (per channel too), then 2**-e, each step: no sum in raw e4m3 units (up to 448x the output)
        # that could overflow float32 where the output does not, and no factor s * 2**-e below float32's normals
        if PER_CHANNEL:
            s = tl.load(s_ptr + n, mask=n_ok, other=0.0)
        else:
            s = tl.load(s_ptr + (n // SBN) * KG + st, mask=n_ok, other=0.0)
        acc += (part * s[:, None]) * down[None, :]
    elif DOT:
        k = st * K_GROUP + tl.arange(0, K_GROUP)
        x = tl.load(x_ptr + m[:, None] * x_stride + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        if FP32:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))  # e4m3 -> bf16/fp16 is exact
        if PER_CHANNEL:
            acc += part
        else:
            acc += part * tl.load(s_ptr + (n // SBN) * KG + st, mask=n_ok, other=0.0)[None, :]
    else:
        g = st * (BLOCK_K // K_GROUP) + tl.arange(0, BLOCK_K // K_GROUP)  # [G] this step's groups
        k = g[:, None] * K_GROUP + tl.arange(0, K_GROUP)[None, :]  # [G, 128]
        xm = (m[:, None, None] < M) & (k[None, :, :] < K)
        x = tl.load(x_ptr + m[:, None, None] * x_stride + k[None, :, :], mask=xm, other=0.0)  # [BLOCK_M, G, 128]
        part = tl.sum(x.to(tl.float32)[:, None, :, :] * w.to(tl.float32)[None, :, :, :], axis=3)  # [BM, BN, G]
        if not PER_CHANNEL:
            sm = n_ok[:, None] & (g[None, :] < KG)
            part *= tl.load(s_ptr + (n // SBN)[:, None] * KG + g[None, :], mask=sm, other=0.0)[None, :, :]
        acc += tl.sum(part, axis=2)
    return acc


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, KG, steps_per_split, x_stride, w_stride, split,
    SBN: tl.constexpr, PER_CHANNEL: tl.constexpr, FP32: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr, TC: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N
    w_rows = w_ptr + n[:, None].to(tl.int64) * w_stride  # [BLOCK_N, 1]
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    w = _w_tile(w_rows, n_ok, first, K, BLOCK_K, DOT or TC)  # in flight before the wait: weights are never written
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if TC:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _step(acc, w, x_ptr, s_ptr, m, n, n_ok, M, K, KG, x_stride, first, SBN, PER_CHANNEL, FP32, DOT, TC,
                BLOCK_K)  # fmt: skip
    for st in range(first + 1, last):
        w = _w_tile(w_rows, n_ok, st, K, BLOCK_K, DOT or TC)
        acc = _step(acc, w, x_ptr, s_ptr, m, n, n_ok, M, K, KG, x_stride, st, SBN, PER_CHANNEL, FP32, DOT, TC,
                    BLOCK_K)  # fmt: skip
    if TC:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N], every scale applied
    elif PER_CHANNEL:
        acc *= tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
    split_k_store(acc, y_ptr, b_ptr, part_ptr, cnt_ptr, pid_n, pid_k, m, n, M, N, split, HAS_BIAS)


@triton.jit
def split_k_store(acc, y_ptr, b_ptr, part_ptr, cnt_ptr, pid_n, pid_k, m, n, M, N, split, HAS_BIAS: tl.constexpr):
    """y[m, n] = acc (+ bias) [BLOCK_M, BLOCK_N]; with split > 1 through the partials and the column tile's ticket."""
    m_ok, n_ok = m < M, n < N
    out_mask = m_ok[:, None] & n_ok[None, :]
    mn = m[:, None] * N + n[None, :]  # [BLOCK_M, BLOCK_N] offsets in y [M, N] and in each partial [M, N]
    # `split` a runtime value, not a constexpr: one compile serves every shape (Triton still specializes split == 1)
    if split > 1:  # partials [split, M, N] fp32; the last program of this column tile adds them up
        tl.store(part_ptr + pid_k * M * N + mn, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stored before the ticket (release: visible to its taker)
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == split - 1:
            acc = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, split):  # fixed order: the same sum whichever program finished last
                acc += tl.load(part_ptr + s * M * N + mn, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + mn, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # zero for the next call / replay
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + mn, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _s_tile(w_rows, n_ok, st, K, BLOCK_K: tl.constexpr, HALF: tl.constexpr):
    """Step `st`'s weight tile for the streaming path, e4m3 [BLOCK_N, BLOCK_K] (W_VEC contiguous bytes a thread:
    the contiguity hint caps the load's vector at W_VEC, which sets the tile's layout); HALF: the same bytes as
    int32 words [BLOCK_N, BLOCK_K / 4] (`w_rows` then points at words; K a multiple of W_VEC)."""
    if HALF:
        kw = tl.max_contiguous(st * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4), W_VEC // 4)
        k_words = tl.multiple_of(K // 4, 2)  # K: a multiple of W_VEC (fp8_gemv checks), so a run is never cut
        tile = tl.load(w_rows + kw[None, :], mask=n_ok[:, None] & (kw[None, :] < k_words), other=0)
    else:
        k = tl.max_contiguous(st * BLOCK_K + tl.arange(0, BLOCK_K), W_VEC)
        tile = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
    return tile


@triton.jit
def _e4m3_bits(w):
    """e4m3 -> float32 times 2**-E4M3_BITS_SHIFT, by integer ops alone: the sign to bit 31, exponent and mantissa
    (7 bits) to bits 26..20, so the float32's exponent field holds e4m3's (bias 7 where float32's is 127). Exact
    for every finite value, subnormals included (they land on float32 subnormals, which the products keep)."""
    u = w.to(tl.uint8, bitcast=True).to(tl.uint32)
    return (((u & 0x80) << 24) | ((u & 0x7F) << 20)).to(tl.float32, bitcast=True)


# "stream" with `half`: a run of W_VEC e4m3 weights (two 32-bit words) times x's 8 columns (four float16 pairs)
# in packed float16: 4 conversions (e4m3x2 -> f16x2), 4 multiply-adds, the run's sum to float32. Triton's own
# lowering of the conversion path unpacks each byte to a register and packs the pairs again for the conversion,
# then converts each f16 to f32 and multiplies per weight: its K loop issues 360 instructions a thread per 64 weight
# bytes (8 rows x 1024 columns a step, 4 warps), 23 bytes a clock per SM at most (4 warp instructions a clock),
# near the ~18 an H200's memory delivers; this one 182 (bench/diag/gemv_sass.py). Each product is below 448 * 16
# (x's run rescaled, `_x_pairs_f16`) and each half of the packed sum adds four: within float16's 65504.
RUN_F16_ASM = tl.constexpr("""{
.reg .b16 a0, a1, a2, a3;
.reg .b32 h0, h1, h2, h3, p;
.reg .f16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 {a0, a1}, $1;
mov.b32 {a2, a3}, $2;
cvt.rn.f16x2.e4m3x2 h0, a0;
cvt.rn.f16x2.e4m3x2 h1, a1;
cvt.rn.f16x2.e4m3x2 h2, a2;
cvt.rn.f16x2.e4m3x2 h3, a3;
mul.rn.f16x2 p, h0, $3;
fma.rn.f16x2 p, h1, $4, p;
fma.rn.f16x2 p, h2, $5, p;
fma.rn.f16x2 p, h3, $6, p;
mov.b32 {lo, hi}, p;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")


@triton.jit
def _x_pairs_f16(x, RUNS: tl.constexpr):
    """x [BLOCK_K] float32 (a 16-bit activation row's step columns) -> four [RUNS] int32 words, each a pair of a
    run's columns as float16x2 (column 2j in the low half), of x * 2**e with e per run putting the run's largest |x|
    in [8, 16) (every bf16 column down to 2**-18 of it stays exact), and 2**-e [RUNS]. Per run, not per row: the
    run's columns are one thread's, so no cross-thread max. e from the float32 exponent bits (exact, no log2)."""
    xr = tl.reshape(x, (RUNS, W_VEC))
    amax = tl.max(tl.abs(xr), axis=1)  # [RUNS]
    exp = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)) (amax normal)
    e = tl.minimum(tl.maximum(tl.where(amax > 0, 3 - exp, 0), -126), 126)
    up = ((127 + e) << 23).to(tl.float32, bitcast=True)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    h = (xr * up[:, None]).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # [RUNS, W_VEC]
    lo, hi = tl.split(tl.reshape(h, (RUNS, 4, 2)))  # [RUNS, 4]: columns 2j, 2j + 1 of each run
    pairs = tl.reshape(lo | (hi << 16), (RUNS, 2, 2))  # pair 2a + b of each run at [run, a, b]
    p02, p13 = tl.split(pairs)  # b = 0: pairs 0, 2; b = 1: pairs 1, 3
    p0, p2 = tl.split(p02)
    p1, p3 = tl.split(p13)
    return p0, p1, p2, p3, down


@triton.jit
def _s_step(acc, w, x_ptr, s_ptr, n, n_ok, row_block, M, K, KG, x_stride, st, SBN: tl.constexpr,
            SCALES: tl.constexpr, ACC_K: tl.constexpr, BITS: tl.constexpr, HALF: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc += the weight tile w [BLOCK_N, BLOCK_K] times x's step `st` columns, row by row of x, in float32.
    Each thread first sums its own runs of W_VEC columns (q [BLOCK_N, BLOCK_K / W_VEC]: no data leaves the
    thread), where the block scale applies (a run lies inside one 128-column group); then q joins acc
    [BLOCK_N, BLOCK_M] summed along K (a cross-thread sum a step), or with ACC_K acc [BLOCK_M, BLOCK_N,
    BLOCK_K / W_VEC] as it is (x's row i into acc[i]), summed once after the loop. The products keep the weight
    tile's layout (a 3D [M, N, K] product's layout would differ from the load's: a shared-memory round trip a
    step). SCALES 0: per channel (applied by the caller), 1: the program's rows share one scale row, 2: a scale
    row per row. BITS: the weights widened by integer ops instead of the conversion instructions (`_e4m3_bits`),
    x's columns times 2**X_SHIFT; the caller multiplies the sums by 2**(E4M3_BITS_SHIFT - X_SHIFT). HALF: w is
    the tile as int32 words (`_s_tile`), each run multiplied in packed float16 (RUN_F16_ASM, `_x_pairs_f16`), the
    runs' sums joining acc in float32."""
    RUNS: tl.constexpr = BLOCK_K // W_VEC
    k = st * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = k < K
    if BITS:
        wf = _e4m3_bits(w)
    elif HALF:  # w: [BLOCK_N, BLOCK_K / 4] int32, four e4m3 a word (`_s_tile`)
        w_lo, w_hi = tl.split(tl.reshape(w, (w.shape[0], RUNS, 2)))  # [BLOCK_N, RUNS] each: a run's two words
    else:
        wf = w.to(tl.float32)
    grp = (st * RUNS + tl.arange(0, RUNS)) // (K_GROUP // W_VEC)  # [RUNS] each run's scale group
    if SCALES == 1:
        s = tl.load(s_ptr + row_block * KG + grp, mask=grp < KG, other=0.0)[None, :]
    if SCALES == 2:
        s = tl.load(s_ptr + (n // SBN)[:, None] * KG + grp[None, :], mask=n_ok[:, None] & (grp[None, :] < KG),
                    other=0.0)  # fmt: skip
    for i in tl.static_range(BLOCK_M):
        x = tl.load(x_ptr + i * x_stride + k, mask=k_ok & (i < M), other=0.0).to(tl.float32)  # [BLOCK_K]
        if BITS:
            x *= X_SCALE
        if HALF:
            p0, p1, p2, p3, down = _x_pairs_f16(x, RUNS)
            q = tl.inline_asm_elementwise(
                RUN_F16_ASM, "=r,r,r,r,r,r,r",
                [w_lo, w_hi, tl.broadcast_to(p0[None, :], w_lo.shape), tl.broadcast_to(p1[None, :], w_lo.shape),
                 tl.broadcast_to(p2[None, :], w_lo.shape), tl.broadcast_to(p3[None, :], w_lo.shape)],
                dtype=tl.float32, is_pure=True, pack=1,
            ) * down[None, :]  # fmt: skip
        else:
            q = tl.sum(tl.reshape(wf * x[None, :], (wf.shape[0], RUNS, W_VEC)), axis=2)  # [BLOCK_N, RUNS]
        if SCALES != 0:
            q *= s
        if ACC_K:
            if BLOCK_M == 1:
                acc += q[None, :, :]
            else:
                acc += tl.where(tl.arange(0, BLOCK_M)[:, None, None] == i, q[None, :, :], 0.0)
        elif BLOCK_M == 1:
            acc += tl.sum(q, axis=1)[:, None]
        else:
            acc += tl.where(tl.arange(0, BLOCK_M)[None, :] == i, tl.sum(q, axis=1)[:, None], 0.0)
    return acc


@triton.jit
def _fp8_stream_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, KG, steps_per_split, x_stride, w_stride, split,
    SBN: tl.constexpr, SCALES: tl.constexpr, ACC_K: tl.constexpr, PREFETCH: tl.constexpr, HAS_BIAS: tl.constexpr,
    BITS: tl.constexpr, HALF: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Path "stream": the bf16 GEMV's shape (kernels/gemv.py) over e4m3 bytes; a program streams BLOCK_N rows in
    [BLOCK_N, BLOCK_K] steps (W_VEC contiguous bytes a thread a row), products and sums on the CUDA cores in
    float32; PREFETCH: the next step's tile loaded before this step's math (two tiles in flight a program, at
    the cost of the registers that hold the second)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok = n < N
    row_block = (pid_n * BLOCK_N) // SBN  # SCALES 1: every row of the program is in this block row
    if HALF:  # the rows as int32 words (w_stride a multiple of W_VEC: fp8_gemv checks)
        words = tl.multiple_of(w_stride // 4, 2)
        w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + n[:, None].to(tl.int64) * words  # [BLOCK_N, 1]
    else:
        w_rows = w_ptr + n[:, None].to(tl.int64) * w_stride  # [BLOCK_N, 1]
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    w = _s_tile(w_rows, n_ok, first, K, BLOCK_K, HALF)  # in flight before the wait: weights are never written
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    if ACC_K:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // W_VEC), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for st in range(first + 1, last):
        if PREFETCH:  # the next tile's loads issued before this step's math
            w_next = _s_tile(w_rows, n_ok, st, K, BLOCK_K, HALF)
            acc = _s_step(acc, w, x_ptr, s_ptr, n, n_ok, row_block, M, K, KG, x_stride, st - 1, SBN, SCALES, ACC_K,
                          BITS, HALF, BLOCK_M, BLOCK_K)  # fmt: skip
            w = w_next
        else:
            acc = _s_step(acc, w, x_ptr, s_ptr, n, n_ok, row_block, M, K, KG, x_stride, st - 1, SBN, SCALES, ACC_K,
                          BITS, HALF, BLOCK_M, BLOCK_K)  # fmt: skip
            w = _s_tile(w_rows, n_ok, st, K, BLOCK_K, HALF)
    acc = _s_step(acc, w, x_ptr, s_ptr, n, n_ok, row_block, M, K, KG, x_stride, last - 1, SBN, SCALES, ACC_K, BITS,
                  HALF, BLOCK_M, BLOCK_K)  # fmt: skip
    if ACC_K:
        out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    else:
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if BITS:
        out *= OUT_SCALE
    if SCALES == 0:
        out *= tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
    split_k_store(out, y_ptr, b_ptr, part_ptr, cnt_ptr, pid_n, pid_k, m, n, M, N, split, HAS_BIAS)


def split_k(n: int, steps: int, block_n: int, programs: int) -> int:
    """Programs along K: enough that the grid has about `programs` programs (1 where the output channels give at
    least half of them: the partials' round trip costs more than the missing parallelism), at most one per step
    of the K loop."""
    tiles = triton.cdiv(n, block_n)
    if 2 * tiles >= programs:
        return 1
    return max(1, min(steps, round(programs / tiles)))


def counter_slots(n: int) -> int:
    """Split-K counters a layer of `n` output channels needs at any block_n >= MIN_BLOCK_N."""
    return triton.cdiv(n, MIN_BLOCK_N)


def takes(path: str, m: int, dtype: torch.dtype) -> bool:
    """Whether `path` takes `m` rows of x in `dtype` (PATH_MAX_ROWS; "tc": 16-bit x only)."""
    return m <= PATH_MAX_ROWS[path] and (path != "tc" or dtype in (torch.bfloat16, torch.float16))


def choose_path(path: str, m: int) -> str:
    """The path `fp8_gemv` runs at `m` rows for `path` ("auto": AUTO_STREAM_ROWS, AUTO_FMA_ROWS, else "dot")."""
    assert path in ("auto", *PATH_MAX_ROWS), path
    if path == "auto":
        path = "stream" if m <= AUTO_STREAM_ROWS else "fma" if m <= AUTO_FMA_ROWS else "dot"
    assert m <= PATH_MAX_ROWS[path], (path, m)
    return path


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale_rows: int = 0,
    out_dtype: torch.dtype | None = None,
    block_n: int = 0,
    block_k: int = 0,
    num_warps: int = 0,
    num_stages: int = 0,
    programs_per_sm: int = 0,
    split: int = 0,
    pdl: bool = False,
    counters: torch.Tensor | None = None,
    path: str = "auto",
    acc_k: bool | None = None,
    prefetch: bool | None = None,
    bits: bool | None = None,
    half: bool | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= MAX_M; bf16, fp16 or fp32), w e4m3 [N, K], scale float32: [N] per channel (scale_rows=0),
    else [ceil(N/scale_rows), ceil(K/128)] (scale_rows 128: 128x128 blocks, 1: per row per 128 columns); bias [N]
    | None -> [M, N] in `out_dtype` (default x's dtype). Launch settings left 0 come from SHAPE_CONFIGS, else the
    path's DEFAULTS entry; block_k is capped by the CUDA-core paths' register budgets (FMA_WARP_ELEMENTS: fewer
    columns a step at larger BLOCK_M; STREAM_THREAD_ELEMENTS); `split`: programs along K (0: from the SM
    count); `counters`: int32 [>= ceil(N / block_n)], zero (the kernel leaves them zero), for split-K (None: a
    zeroed tensor per call); `pdl`: programmatic dependent launch (Hopper); `path`: "auto" (choose_path),
    "stream", "fma", "dot" or "tc" (PATH_MAX_ROWS: the most rows each takes); "stream" only (None: from the config):
    `acc_k`: run sums kept elementwise until after the K loop (where they fit STREAM_ACC_THREAD_ELEMENTS);
    `prefetch`: the next tile's loads before this tile's math; `bits`: e4m3 widened by integer ops (`_e4m3_bits`);
    `half`: products and run sums in packed float16 (RUN_F16_ASM; x rescaled per run by a power of two)."""
    m, k = x.shape
    n = w.shape[0]
    kg = triton.cdiv(k, GROUP)
    assert m <= MAX_M and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1 and scale.is_contiguous()
    if scale_rows:
        assert scale.shape == (triton.cdiv(n, scale_rows), kg), (scale.shape, n, k, scale_rows)
    else:
        assert scale.shape == (n,), (scale.shape, n)
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    path = choose_path(path, m)
    assert takes(path, m, x.dtype), f"path {path!r} takes 16-bit x, not {x.dtype}"  # (choose_path checked the rows)
    cfg = SHAPE_CONFIGS.get((path, triton.next_power_of_2(m), n, k), DEFAULTS[path])
    block_n, num_warps = block_n or cfg["block_n"], num_warps or cfg["num_warps"]
    num_stages, programs_per_sm = num_stages or cfg["num_stages"], programs_per_sm or cfg["programs_per_sm"]
    acc_k = cfg.get("acc_k", False) if acc_k is None else acc_k
    prefetch = cfg.get("prefetch", True) if prefetch is None else prefetch
    bits = cfg.get("bits", False) if bits is None else bits
    # `half` needs whole runs of W_VEC bytes as int32 words, 16-bit activations (float16 keeps their bits) and a
    # device (Triton's interpreter runs no inline PTX); a config's `half` yields where those lack or to `bits`
    fits = x.is_cuda and k % 8 == 0 and w.stride(0) % 8 == 0 and x.dtype in (torch.bfloat16, torch.float16)
    assert not (half and bits), "bits and half are two ways to widen the weights: one at a time"
    assert not half or fits, f"half takes 16-bit x on a device and K a multiple of 8, not {x.dtype}, {k}"
    half = (cfg.get("half", False) and fits and not bits) if half is None else half
    half = half and path == "stream"
    scales = 0 if not scale_rows else 1 if scale_rows % block_n == 0 else 2  # "stream": 1 = one scale row a program
    acc_k = acc_k and path == "stream"
    block_m = 16 if path in ("dot", "tc") else triton.next_power_of_2(m)
    if path in ("dot", "tc"):
        block_k = GROUP
    else:  # columns a step within the register budget (a power of 2, at least one group); "stream" multiplies
        # x's rows one after another by the same tile, so its budget does not shrink with M
        if path == "fma":
            most = FMA_WARP_ELEMENTS * num_warps // (block_m * block_n)
        else:
            most = (
                (STREAM_THREAD_ELEMENTS if prefetch else STREAM_THREAD_ELEMENTS_NO_PREFETCH) * 32 * num_warps // block_n
            )
        block_k = max(GROUP, min(block_k or cfg["block_k"], triton.next_power_of_2(most + 1) // 2))
    assert block_k % GROUP == 0 and triton.next_power_of_2(block_k) == block_k, block_k
    acc_k = acc_k and block_m * block_n * block_k // W_VEC <= STREAM_ACC_THREAD_ELEMENTS * 32 * num_warps
    assert block_n >= MIN_BLOCK_N and triton.next_power_of_2(block_n) == block_n, block_n
    steps = triton.cdiv(k, block_k)
    if not split:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        split = split_k(n, steps, block_n, programs_per_sm * sms)
    per_split = triton.cdiv(steps, min(split, steps))
    split = triton.cdiv(steps, per_split)  # no program without a step
    tiles = triton.cdiv(n, block_n)
    part = y
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        if counters is None:
            counters = torch.zeros(tiles, dtype=torch.int32, device=x.device)
        assert counters.dtype == torch.int32 and counters.numel() >= tiles, (counters.shape, tiles)
    args = (x, w, scale, bias if bias is not None else scale, y, part, counters if counters is not None else scale,
            m, n, k, kg, per_split, x.stride(0), w.stride(0), split)  # fmt: skip
    launch = dict(num_warps=num_warps, num_stages=num_stages, **(dict(launch_pdl=True) if pdl else {}))
    sbn = max(scale_rows, 1)
    if path == "stream":
        _fp8_stream_kernel[(tiles, split)](*args, SBN=sbn, SCALES=scales, ACC_K=acc_k, PREFETCH=prefetch,
                                           HAS_BIAS=bias is not None, BITS=bits, HALF=half,
                                           USE_PDL=pdl, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                           **launch)  # fmt: skip
    else:
        _fp8_gemv_kernel[(tiles, split)](
            *args, SBN=sbn, PER_CHANNEL=not scale_rows, FP32=x.dtype == torch.float32, HAS_BIAS=bias is not None,
            DOT=path == "dot", TC=path == "tc", USE_PDL=pdl, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            **launch,
        )  # fmt: skip
    return y
