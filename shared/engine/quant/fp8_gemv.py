"""Triton kernel: y = x @ (W * scale)^T (+ b) over e4m3 weights for decode-sized batches (M <= MAX_M tokens).

Weight-only dequantization: the activations stay in their dtype (bf16 in the engine; no activation quantizer
launch) and the work is reading the weight bytes, so the kernel keeps many of them in flight. Each program owns
BLOCK_N output channels and a contiguous run of K; each step loads a [BLOCK_N, BLOCK_K] e4m3 tile (BLOCK_K a
power-of-2 multiple of the 128-column scale group) and multiplies it in one of two ways:
- path "fma" (M <= FMA_MAX_ROWS, batch 1..4; chosen explicitly, "auto" never takes it: AUTO_FMA_ROWS): on the CUDA
  cores in float32, the tile viewed as [BLOCK_N, BLOCK_K / 128, 128]
  so that each 128-column group's partial sum meets its own block scale (no tensor-core tile of 16 rows mostly
  masked, no shared-memory round trip); BLOCK_K up to 2048 columns (one 16-byte load per thread per row chunk);
- path "dot" (every M under "auto"): one 128-column group per step on the tensor cores (e4m3 -> activation dtype
  is exact, fp32 sum).
Scales: per channel (scale [N]) once per program at the end; per 128x128 block (scale [ceil(N/128), ceil(K/128)])
or per row per 128 columns (`scale_rows=1`) per group, before the group's sum joins the accumulator.

Split-K (`SPLIT` programs along K, where the output channels alone give too few programs): each program writes
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
FMA_MAX_ROWS = 4  # the CUDA-core path ("fma") takes at most this many rows
# "auto" takes the tensor-core path at every M: it keeps more weight bytes in flight per SM than the CUDA-core path,
# whose float32 products are register-bound at the tile widths that would hide the load latency
AUTO_FMA_ROWS = 0
GROUP = 128  # columns of one block-scale group
K_GROUP = tl.constexpr(GROUP)  # the same, as kernels read globals
FMA_WARP_ELEMENTS = 2048  # most BLOCK_M x BLOCK_N x BLOCK_K of the CUDA-core product a step, per warp (64 a thread)
# per path: BLOCK_N output channels a program, BLOCK_K columns a step (CUDA cores: capped by FMA_WARP_ELEMENTS),
# launch; programs_per_sm: the grid the split aims at (H200: 132 SMs)
DEFAULT_FMA = dict(block_n=16, block_k=512, num_warps=4, num_stages=3, programs_per_sm=4)
DEFAULT_DOT = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=4)
# the configurations bench/fp8_weights.py times at M = 1 (the last: the tensor-core path, the first version's)
SWEEP_CONFIGS = [
    dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, programs_per_sm=pps)
    for bn, bk, nw, ns, pps in [
        (8, 1024, 4, 3, 4), (16, 1024, 4, 2, 4), (32, 256, 4, 3, 4), (16, 2048, 8, 2, 2), (8, 512, 2, 3, 8),
        (64, 128, 4, 4, 4),
    ]
] + [dict(path="dot", **DEFAULT_DOT)]  # fmt: skip


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
def _step(acc, w, x_ptr, s_ptr, m, n, n_ok, M, K, KG, x_stride, st, SBN: tl.constexpr, PER_CHANNEL: tl.constexpr,
          FP32: tl.constexpr, DOT: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] += x's step `st` columns times the weight tile `w` (block scales applied)."""
    if DOT:
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
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, KG, steps_per_split, x_stride, w_stride,
    SBN: tl.constexpr, PER_CHANNEL: tl.constexpr, FP32: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr, USE_PDL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * w_stride  # [BLOCK_N, 1]
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    w = _w_tile(w_rows, n_ok, first, K, BLOCK_K, DOT)  # in flight before the wait: weights are never written
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _step(acc, w, x_ptr, s_ptr, m, n, n_ok, M, K, KG, x_stride, first, SBN, PER_CHANNEL, FP32, DOT, BLOCK_K)
    for st in range(first + 1, last):
        w = _w_tile(w_rows, n_ok, st, K, BLOCK_K, DOT)
        acc = _step(acc, w, x_ptr, s_ptr, m, n, n_ok, M, K, KG, x_stride, st, SBN, PER_CHANNEL, FP32, DOT, BLOCK_K)
    if PER_CHANNEL:
        acc *= tl.load(s_ptr + n, mask=n_ok, other=0.0)[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    mn = m[:, None] * N + n[None, :]  # [BLOCK_M, BLOCK_N] offsets in y [M, N] and in each partial [M, N]
    if SPLIT > 1:  # partials [SPLIT, M, N] fp32; the last program of this column tile adds them up
        tl.store(part_ptr + pid_k * M * N + mn, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stored before the ticket (release: visible to its taker)
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, SPLIT):  # fixed order: the same sum whichever program finished last
                acc += tl.load(part_ptr + s * M * N + mn, mask=out_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + mn, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # zero for the next call / replay
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + mn, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def split_k(n: int, steps: int, block_n: int, programs: int) -> int:
    """Programs along K: enough that the grid has about `programs` programs (1 where the output channels give at
    least half of them: the partials' round trip costs more than the missing parallelism), at most one per step
    of the K loop."""
    tiles = triton.cdiv(n, block_n)
    if 2 * tiles >= programs:
        return 1
    return max(1, min(steps, round(programs / tiles)))


def counter_slots(n: int) -> int:
    """Split-K counters a layer of `n` output channels needs at any block_n >= 8."""
    return triton.cdiv(n, 8)


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
) -> torch.Tensor:
    """x [M, K] (M <= MAX_M; bf16, fp16 or fp32), w e4m3 [N, K], scale float32: [N] per channel (scale_rows=0),
    else [ceil(N/scale_rows), ceil(K/128)] (scale_rows 128: 128x128 blocks, 1: per row per 128 columns); bias [N]
    | None -> [M, N] in `out_dtype` (default x's dtype). Launch settings left 0 come from DEFAULT_FMA / DEFAULT_DOT
    (block_k: at most what 64 fp32 registers a thread hold of the CUDA-core product, so fewer columns at larger
    BLOCK_M); `split`: programs along K (0:
    from the SM count); `counters`: int32 [>= ceil(N / block_n)], zero (the kernel leaves them zero), for split-K
    (None: a zeroed tensor per call); `pdl`: programmatic dependent launch (Hopper); `path`: "auto" (CUDA cores
    up to AUTO_FMA_ROWS rows, else tensor cores), "fma" or "dot" (M <= 4 only: CUDA cores)."""
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
    assert path in ("auto", "fma", "dot") and (path != "fma" or m <= FMA_MAX_ROWS), (path, m)
    dot = m > AUTO_FMA_ROWS if path == "auto" else path == "dot"
    cfg = dict(DEFAULT_DOT if dot else DEFAULT_FMA)
    block_n, num_warps = block_n or cfg["block_n"], num_warps or cfg["num_warps"]
    num_stages, programs_per_sm = num_stages or cfg["num_stages"], programs_per_sm or cfg["programs_per_sm"]
    block_m = 16 if dot else triton.next_power_of_2(m)
    most = FMA_WARP_ELEMENTS * num_warps // (block_m * block_n)  # columns a step within the register budget
    block_k = GROUP if dot else max(GROUP, min(block_k or cfg["block_k"], triton.next_power_of_2(most + 1) // 2))
    assert block_k % GROUP == 0 and triton.next_power_of_2(block_k) == block_k, block_k
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
    _fp8_gemv_kernel[(tiles, split)](
        x, w, scale, bias if bias is not None else scale, y, part, counters if counters is not None else scale,
        m, n, k, kg, per_split, x.stride(0), w.stride(0),
        SBN=max(scale_rows, 1), PER_CHANNEL=not scale_rows, FP32=x.dtype == torch.float32, SPLIT=split,
        HAS_BIAS=bias is not None, DOT=dot, USE_PDL=pdl, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **(dict(launch_pdl=True) if pdl else {}),
    )  # fmt: skip
    return y
