"""Triton kernel: block-scaled FP8 GEMM, out = (A * a_scale) @ (B * b_scale)^T (and its per-channel variant).

A e4m3 [M, K] with one float32 scale per token per 128 columns (a_scale [M, K/128]); B e4m3 [N, K] (row-major,
as checkpoints store it) with one float32 scale per 128x128 block (b_scale [ceil(N/128), ceil(K/128)]), or per
row per 128 columns (`scale_rows=1`, b_scale [N, ceil(K/128)]: fused projections whose parts do not fill whole
128-row blocks). Each step
of the K loop covers exactly one scale group: the tensor-core partial sum of that group is multiplied by the
row's activation scale and the column's weight-block scale before it is added to the float32 accumulator. No host
sync: capturable in CUDA graphs. Tails of M, N and K are masked.

The same kernel with PER_CHANNEL scales (a_scale [M, 1] per token, b_scale [N] per output channel) applies them
once after the K loop: `channel_gemm`, a Triton alternative to `torch._scaled_mm` with quantized activations (the
bench's comparison row; decode-sized M in Fp8Linear takes the weight-only GEMV, fp8_gemv.py). Fp8Linear runs
block-scaled layers through cuBLAS's block-scaled `torch._scaled_mm` where it can (N and K multiples of 128);
this kernel is the fallback (and the path of fused parts whose scales are per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.engine.quant.fp8_gemv import split_k_store

SCALE_BLOCK = 128  # rows and columns of one weight scale block; columns of one activation scale group


@triton.jit
def _tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program `pid`'s (row tile, column tile) in grouped order: GROUP_M row tiles share the B tiles they read while
    in L2."""
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


@triton.jit
def _write(acc, c_ptr, part_ptr, cnt_ptr, pid, pid_k, offs_m, offs_n, M, N, split, stride_cm):
    """C's tile = acc [BM, BN]; with split-K through the partials and the tile's ticket (fp8_gemv.split_k_store:
    the last program adds them up in a fixed order)."""
    if split > 1:
        split_k_store(acc, c_ptr, c_ptr, part_ptr, cnt_ptr, pid, pid_k, offs_m, offs_n, M, N, split, False)
    else:
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _block_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, part_ptr, cnt_ptr, M, N, K, KG, steps_per_split, split, stride_am, stride_bn,
    stride_cm, SB: tl.constexpr, SBN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, PER_CHANNEL: tl.constexpr,
):  # fmt: skip
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    pid_m, pid_n = _tile(pid, M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok, n_ok = offs_m < M, offs_n < N
    first = pid_k * steps_per_split  # this program's K steps (split-K: `split` programs share a tile's K)
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BK))
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (first * BK + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + (first * BK + offs_k)[:, None]  # [BK, BN] of B^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(first, last):
        k_left = K - kb * BK
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & (offs_k[:, None] < k_left), other=0.0)
        if PER_CHANNEL:
            acc += tl.dot(a, b)
        else:  # BK == SB: step kb is scale group kb
            sa = tl.load(as_ptr + offs_m * KG + kb, mask=m_ok, other=0.0)  # [BM]: this group's token scales
            sb = tl.load(bs_ptr + (offs_n // SBN) * KG + kb, mask=n_ok, other=0.0)  # [BN]: this group's blocks
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BK
        b_ptrs += BK
    if PER_CHANNEL:  # linear in the partial sums: each split's part scaled before the reduction
        acc *= tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)[:, None] * tl.load(bs_ptr + offs_n, mask=n_ok)[None, :]
    _write(acc, c_ptr, part_ptr, cnt_ptr, pid, pid_k, offs_m, offs_n, M, N, split, stride_cm)


@triton.jit
def _channel_gemm_tma_kernel(
    a_desc, b_desc, as_ptr, bs_ptr, c_ptr, part_ptr, cnt_ptr, M, N, K, steps_per_split, split, stride_cm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """The per-channel GEMM with its operand tiles brought in by the Hopper tensor-memory accelerator (TMA): a_desc
    over A [M, K] in [BM, BK] boxes, b_desc over B [N, K] in [BN, BK] boxes, zero-filled past the edges (no masks);
    grid, split-K and scales as `_block_gemm_kernel`'s."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    pid_m, pid_n = _tile(pid, M, N, BM, BN, GROUP_M)
    first = pid_k * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BK))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(first, last):
        a = a_desc.load([pid_m * BM, kb * BK])  # [BM, BK] e4m3
        b = b_desc.load([pid_n * BN, kb * BK])  # [BN, BK] e4m3
        acc = tl.dot(a, b.T, acc)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc *= tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)[:, None] * tl.load(bs_ptr + offs_n, mask=n_ok)[None, :]
    _write(acc, c_ptr, part_ptr, cnt_ptr, pid, pid_k, offs_m, offs_n, M, N, split, stride_cm)


# prefill / large-batch tiles, largest first: (BM, BN, num_warps, num_stages); `default_config` takes the first
# whose grid fills the GPU (H200: 132 SMs), so M = 128 no longer runs 32 programs of 128x128 on 132 SMs
TILES = ((128, 128, 8, 3), (64, 128, 4, 4), (64, 64, 4, 4))
# the alternatives to `TILES` bench/fp8_weights.py times at M = 128 and 2048 (details of docs/bench/fp8_weights.json)
SWEEP_CONFIGS = [
    dict(BM=bm, BN=bn, GROUP_M=8, num_warps=nw, num_stages=ns)
    for bm, bn, nw, ns in [(128, 128, 8, 4), (128, 256, 8, 3), (64, 128, 4, 3), (128, 64, 4, 4), (64, 256, 8, 3)]
]  # fmt: skip
# decode batches above the GEMV (17..SKINNY_MAX_ROWS tokens) are bound by the weight bytes: narrow column tiles,
# the row tiles of one column tile next to each other (each weight byte read from HBM once), split-K (`split`
# programs along K, partial sums added by each tile's last program) so that every SM streams weight bytes. A config
# is a tuple (BM, BN, BK, num_warps, num_stages, programs per SM the split aims at (0: no split), TMA loads);
# `config_from_tuple` makes the launch dict
SKINNY_MAX_ROWS = 256
# (per channel, rows rounded up to a power of 2 from 32, N, K) -> the config that beat cuBLAS's `_scaled_mm` on that
# projection by more than 3%, or None where cuBLAS was as fast (it then runs): bench/fp8_gemm_sweep.py prints this
# table from its measurements on the target GPU (an H200: docs/benchmarks.md has the figures)
SKINNY_CONFIGS: dict[tuple[bool, int, int, int], tuple | None] = {
    (True, 32, 6144, 4096): (64, 64, 128, 4, 6, 0, 0),
    (True, 32, 4096, 4096): (64, 64, 128, 4, 6, 2, 0),
    (True, 32, 28672, 4096): (64, 128, 128, 4, 4, 2, 0),
    (True, 32, 4096, 14336): (64, 64, 128, 4, 6, 2, 0),
    (False, 32, 6144, 4096): None,
    (False, 32, 4096, 4096): (64, 64, 128, 4, 4, 2, 0),
    (False, 32, 28672, 4096): (64, 128, 128, 4, 4, 2, 0),
    (False, 32, 4096, 14336): (64, 64, 128, 4, 4, 2, 0),
    (True, 64, 6144, 4096): (64, 64, 128, 4, 6, 0, 0),
    (True, 64, 4096, 4096): (64, 64, 128, 4, 6, 0, 0),
    (True, 64, 28672, 4096): (64, 128, 128, 4, 4, 2, 1),
    (True, 64, 4096, 14336): (64, 64, 128, 4, 6, 2, 0),
    (False, 64, 6144, 4096): None,
    (False, 64, 4096, 4096): (64, 64, 128, 4, 4, 2, 0),
    (False, 64, 28672, 4096): None,
    (False, 64, 4096, 14336): (64, 64, 128, 4, 4, 2, 0),
    (True, 128, 6144, 4096): (64, 64, 128, 4, 6, 2, 1),
    (True, 128, 4096, 4096): (64, 64, 128, 4, 6, 0, 0),
    (True, 128, 28672, 4096): None,
    (True, 128, 4096, 14336): (64, 64, 128, 4, 6, 2, 1),
    (False, 128, 6144, 4096): None,
    (False, 128, 4096, 4096): None,
    (False, 128, 28672, 4096): None,
    (False, 128, 4096, 14336): (128, 64, 128, 4, 4, 2, 0),
    (True, 256, 6144, 4096): None,
    (True, 256, 4096, 4096): (64, 64, 128, 4, 6, 2, 1),
    (True, 256, 28672, 4096): None,
    (True, 256, 4096, 14336): (64, 64, 128, 4, 6, 2, 1),
    (False, 256, 6144, 4096): None,
    (False, 256, 4096, 4096): None,
    (False, 256, 28672, 4096): None,
    (False, 256, 4096, 14336): None,
    (True, 32, 10240, 8192): (64, 64, 128, 4, 6, 0, 0),
    (True, 32, 8192, 8192): (64, 64, 128, 4, 6, 0, 0),
    (True, 32, 57344, 8192): (64, 128, 128, 4, 4, 2, 0),
    (True, 32, 8192, 28672): (64, 64, 128, 4, 6, 2, 0),
    (False, 32, 10240, 8192): None,
    (False, 32, 8192, 8192): (64, 64, 128, 4, 4, 2, 0),
    (False, 32, 57344, 8192): (64, 128, 128, 4, 4, 2, 0),
    (False, 32, 8192, 28672): (64, 128, 128, 4, 4, 2, 0),
    (True, 64, 10240, 8192): (64, 64, 128, 4, 6, 2, 1),
    (True, 64, 8192, 8192): (64, 64, 128, 4, 6, 0, 0),
    (True, 64, 57344, 8192): (64, 128, 128, 4, 4, 2, 1),
    (True, 64, 8192, 28672): (64, 128, 256, 4, 3, 1, 1),
    (False, 64, 10240, 8192): None,
    (False, 64, 8192, 8192): None,
    (False, 64, 57344, 8192): None,
    (False, 64, 8192, 28672): None,
    (True, 128, 10240, 8192): None,
    (True, 128, 8192, 8192): (64, 64, 128, 4, 6, 2, 1),
    (True, 128, 57344, 8192): None,
    (True, 128, 8192, 28672): (64, 64, 128, 4, 6, 2, 1),
    (False, 128, 10240, 8192): None,
    (False, 128, 8192, 8192): None,
    (False, 128, 57344, 8192): None,
    (False, 128, 8192, 28672): None,
    (True, 256, 10240, 8192): None,
    (True, 256, 8192, 8192): None,
    (True, 256, 57344, 8192): None,
    (True, 256, 8192, 28672): None,
    (False, 256, 10240, 8192): None,
    (False, 256, 8192, 8192): None,
    (False, 256, 57344, 8192): None,
    (False, 256, 8192, 28672): None,
}  # fmt: skip
# shapes the table lacks: per channel the config that won most often, up to 64 rows and up to 128 below N = 16384
# (wider layers: cuBLAS); block scales up to 32 rows; cuBLAS elsewhere
SKINNY_RULE_CHANNEL = (64, 64, 128, 4, 6, 2, 0)
SKINNY_RULE_BLOCK = (64, 64, 128, 4, 4, 2, 0)


def rows_bucket(m: int) -> int:
    """SKINNY_CONFIGS' row key of a batch of `m` tokens."""
    return max(32, triton.next_power_of_2(m))


def skinny_tuple(m: int, n: int, k: int, per_channel: bool) -> tuple | None:
    """The split-K config of an `m` x `n` x `k` GEMM, or None where cuBLAS's `_scaled_mm` is the faster choice."""
    if not 16 < m <= SKINNY_MAX_ROWS:
        return None
    key = (per_channel, rows_bucket(m), n, k)
    if key in SKINNY_CONFIGS:
        return SKINNY_CONFIGS[key]
    if per_channel:
        return SKINNY_RULE_CHANNEL if m <= 64 or (m <= 128 and n < 16384) else None
    return SKINNY_RULE_BLOCK if m <= 32 else None


def config_from_tuple(c: tuple, m: int, n: int, k: int, sms: int = 132) -> dict:
    """The launch dict of a config tuple (see SKINNY_CONFIGS) for an `m` x `n` x `k` GEMM on `sms` SMs."""
    bm, bn, bk, num_warps, num_stages, programs_per_sm, tma = c
    grid_m = triton.cdiv(m, bm)
    tiles = grid_m * triton.cdiv(n, bn)
    split = split_for(tiles, triton.cdiv(k, bk), programs_per_sm * sms) if programs_per_sm else 1
    return dict(BM=bm, BN=bn, BK=bk, GROUP_M=grid_m, num_warps=num_warps, num_stages=num_stages, split=split,
                TMA=bool(tma))  # fmt: skip


def skinny_config(m: int, n: int, k: int, per_channel: bool, sms: int = 132, cublas: bool = False) -> dict | None:
    """The launch dict of a decode batch of `m` tokens through the Triton GEMM: the table's or the rule's config;
    where either says cuBLAS, None if `cublas` (it takes the shape), else the rule's config."""
    c = skinny_tuple(m, n, k, per_channel)
    if c is None:
        if cublas:
            return None
        c = SKINNY_RULE_CHANNEL if per_channel else SKINNY_RULE_BLOCK
    return config_from_tuple(c, m, n, k, sms)


def split_for(tiles: int, steps: int, programs: int) -> int:
    """Programs along K so that the grid has about `programs` programs (1 where the tiles give at least half of
    them: the partials' round trip costs more than the missing parallelism), at most one per K step."""
    if 2 * tiles >= programs:
        return 1
    return max(1, min(steps, round(programs / tiles)))


def default_config(m: int, n: int, sms: int = 132, k: int = 0, per_channel: bool = False) -> dict:
    """Tile shape by token count: decode rows (M <= 16) take narrow N tiles, decode batches up to SKINNY_MAX_ROWS
    (with `k` given) `skinny_config`, larger M the largest of `TILES` whose grid covers the `sms` SMs (the
    smallest where none does). The benches (bench/fp8_weights.py, bench/fp8_gemm_sweep.py) time the alternatives."""
    if m <= 16:
        return dict(BM=16, BN=64 if n >= 16384 else 32, GROUP_M=1, num_warps=4, num_stages=4)
    if k and m <= SKINNY_MAX_ROWS:
        skinny = skinny_config(m, n, k, per_channel, sms)
        assert skinny is not None  # without cublas: always a config
        return skinny
    tile = next((t for t in TILES if triton.cdiv(m, t[0]) * triton.cdiv(n, t[1]) >= sms), TILES[-1])
    return dict(BM=tile[0], BN=tile[1], GROUP_M=8, num_warps=tile[2], num_stages=tile[3])


def counter_slots(m: int, n: int) -> int:
    """Split-K tickets (int32, zero between calls) a GEMM of `m` x `n` needs at any tile of BM >= 64 and BN >= 32."""
    return triton.cdiv(m, 64) * triton.cdiv(n, 32)


def _launch(a, a_scale, b, b_scale, out_dtype, config, per_channel: bool, scale_rows: int = 1,
            counters: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 132
    cfg = dict(config or default_config(m, n, sms, k, per_channel))
    bm, bn, bk, split = cfg.pop("BM"), cfg.pop("BN"), cfg.pop("BK", SCALE_BLOCK), cfg.pop("split", 1)
    assert bk % SCALE_BLOCK == 0 and (per_channel or bk == SCALE_BLOCK), bk  # a block step is one scale group
    steps = triton.cdiv(k, bk)
    per_split = triton.cdiv(steps, min(split, steps))
    split = triton.cdiv(steps, per_split)  # no program without a step
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    part = c
    if split > 1:
        part = torch.empty(split, m, n, dtype=torch.float32, device=a.device)  # [split, M, N] partial sums
        if counters is None:
            counters = torch.zeros(tiles, dtype=torch.int32, device=a.device)
        assert counters.dtype == torch.int32 and counters.numel() >= tiles, (counters.shape, tiles)
    tickets = counters if counters is not None else c
    if cfg.pop("TMA", False) and per_channel and _tma_ok(a) and _tma_ok(b):
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(b, [bn, bk])
        _channel_gemm_tma_kernel[(tiles, split)](
            a_desc, b_desc, a_scale, b_scale, c, part, tickets, m, n, k, per_split, split, c.stride(0), BM=bm, BN=bn,
            BK=bk, **cfg,
        )  # fmt: skip
        return c
    _block_gemm_kernel[(tiles, split)](
        a, a_scale, b, b_scale, c, part, tickets, m, n, k, triton.cdiv(k, SCALE_BLOCK), per_split, split, a.stride(0),
        b.stride(0), c.stride(0), SB=SCALE_BLOCK, SBN=scale_rows, BM=bm, BN=bn, BK=bk, PER_CHANNEL=per_channel, **cfg,
    )  # fmt: skip
    return c


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether a [rows, K] e4m3 operand suits a TMA descriptor: its base and row stride 16-byte aligned, unit
    column stride (else the pointer kernel runs)."""
    return t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
    scale_rows: int = SCALE_BLOCK,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """a e4m3 [M, K], a_scale float32 [M, ceil(K/128)], b e4m3 [N, K], b_scale float32 [ceil(N/scale_rows),
    ceil(K/128)] -> [M, N] in `out_dtype`. `config`: tile and split (None: `default_config`); `counters`: int32
    [>= counter_slots(M, N)], zero (the kernel leaves them zero), for split-K (None: a zeroed tensor per call)."""
    m, k = a.shape
    n = b.shape[0]
    kg = -(-k // SCALE_BLOCK)
    assert b.shape[1] == k and a.stride(1) == 1 and b.stride(1) == 1
    assert a_scale.shape == (m, kg) and a_scale.is_contiguous()
    assert scale_rows in (1, SCALE_BLOCK) and b_scale.shape == (-(-n // scale_rows), kg) and b_scale.is_contiguous()
    return _launch(
        a, a_scale, b, b_scale, out_dtype, config, per_channel=False, scale_rows=scale_rows, counters=counters
    )


def channel_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """a e4m3 [M, K], a_scale float32 [M, 1] (per token), b e4m3 [N, K], b_scale float32 [N] (per output
    channel) -> [M, N] in `out_dtype` (`config`, `counters`: as `block_gemm`'s)."""
    m, k = a.shape
    n = b.shape[0]
    assert b.shape[1] == k and a.stride(1) == 1 and b.stride(1) == 1
    assert a_scale.shape == (m, 1) and a_scale.is_contiguous() and b_scale.shape == (n,) and b_scale.is_contiguous()
    return _launch(a, a_scale, b, b_scale, out_dtype, config, per_channel=True, counters=counters)
