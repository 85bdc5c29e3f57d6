"""FP8 e4m3 quantizers in torch ops (weights at load, activations on CPU and as the kernels' reference) and the
activation quantizer as a Triton kernel (CUDA: one launch, no host sync, capturable in CUDA graphs).

Scales are float32 and multiply: x ≈ q * scale, scale = amax / 448 over the group (a row, a row's 128 columns, or
a 128x128 weight block; per-channel weight scales: the best of a few slightly smaller ones, `SCALE_SEARCH`),
q = round-to-nearest-even(x / scale) clamped to ±448.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
AMAX_FLOOR = 1e-12  # an all-zero group gets a tiny scale instead of a division by zero


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


# online quantization at load: rows at a time, so the float32 temporaries stay this small whatever the weight (a 70B
# gate_proj in one piece made three 0.9 GB ones, and the caching allocator kept their blocks, split under later weights)
QUANT_CHUNK_ELEMENTS = 1 << 24


# Per-channel scales are searched: amax / 448 times the factor of these that gives the row the least squared error
# (1.0 first, so never worse than amax). e4m3's grid is relative, so which values fall between its steps depends on
# the scale; a slightly smaller one (clipping the row's largest value a little) often fits the rest better. Factors
# below 0.88 were never the best on real weights (docs/fp8.md has the error and perplexity it buys).
SCALE_SEARCH = tuple(1.0 - 0.01 * i for i in range(13))


def _searched_scales(part: torch.Tensor, amax: torch.Tensor, factors: tuple[float, ...]) -> torch.Tensor:
    """part [rows, K] float32, amax [rows] -> per row the scale amax * f / 448 (f in factors) of least squared
    error after e4m3 rounding."""

    def row_error(s: torch.Tensor) -> torch.Tensor:  # [rows]
        q = (part / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        return q.float().mul_(s[:, None]).sub_(part).square_().sum(dim=1)

    best = amax / FP8_MAX * factors[0]  # [rows]; factor 1.0: exactly the plain scale
    err = row_error(best)
    for f in factors[1:]:
        s = amax / FP8_MAX * f
        e = row_error(s)
        better = e < err
        best, err = torch.where(better, s, best), torch.where(better, e, err)
    return best


def quantize_weight_per_channel(
    w: torch.Tensor, search: tuple[float, ...] = SCALE_SEARCH
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q e4m3 [N, K], scale float32 [N]): one scale per output channel (row), the one of least squared
    error among amax / 448 times each factor of `search` (() or (1.0,): amax / 448)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    step = max(1, QUANT_CHUNK_ELEMENTS // max(k, 1))
    for r in range(0, n, step):
        part = w[r : r + step].to(torch.float32, copy=True)  # [rows, K], a copy: divided in place below
        amax = part.abs().amax(dim=1).clamp(min=AMAX_FLOOR)
        s = _searched_scales(part, amax, search) if len(search) > 1 else amax / FP8_MAX
        scale[r : r + step] = s
        q[r : r + step].copy_(part.div_(s[:, None]).clamp_(-FP8_MAX, FP8_MAX))
    return q, scale


def _block_view(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-n // block[0]), -(-k // block[1])


def quantize_weight_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q e4m3 [N, K], scale_inv float32 [ceil(N/bn), ceil(K/bk)]): one scale per block (the layout
    block-scaled checkpoints ship: w ≈ q * scale_inv[n // bn, k // bk])."""
    n, k = w.shape
    gn, gk = _block_view(n, k, block)
    padded = w.float().new_zeros(gn * block[0], gk * block[1])
    padded[:n, :k] = w.float()
    tiles = padded.view(gn, block[0], gk, block[1])
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / FP8_MAX  # [gn, gk]
    q = _to_fp8(tiles, scale[:, None, :, None]).view(gn * block[0], gk * block[1])[:n, :k]
    return q.contiguous(), scale


def expand_block_scales(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] -> [N, K]: each element's scale."""
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """e4m3 [N, K] and its scales (per channel [N], or per block) -> [N, K] in `dtype` (product in float32)."""
    n, k = q.shape
    s = expand_block_scales(scale, n, k, block) if block is not None else scale.reshape(n, 1)
    return (q.float() * s).to(dtype)


def quantize_activations_torch(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q e4m3 [M, K], scale float32 [M, G]): per token (group None: G = 1) or per token per `group`
    columns (G = ceil(K / group))."""
    m, k = x.shape
    if group is None:
        scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
        return _to_fp8(x, scale), scale
    g = -(-k // group)
    padded = x.float().new_zeros(m, g * group)
    padded[:, :k] = x.float()
    tiles = padded.view(m, g, group)
    scale = tiles.abs().amax(dim=2).clamp(min=AMAX_FLOOR) / FP8_MAX  # [M, G]
    return _to_fp8(tiles, scale[:, :, None]).view(m, g * group)[:, :k].contiguous(), scale


def quantize_activations(
    x: torch.Tensor, group: int | None, col_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `quantize_activations_torch`; on CUDA one Triton launch (`quantize_activations_triton`). `col_major`:
    the scales [M, G] column-major (the layout `torch._scaled_mm` wants for 1x128 blocks)."""
    if x.is_cuda:
        return quantize_activations_triton(x, group, col_major)
    q, s = quantize_activations_torch(x, group)
    return q, (s.t().contiguous().t() if col_major else s)


ACT_QUANT_ONE_PASS = 8192  # columns of a group the kernel keeps in registers (one read of x)


def quantize_activations_triton(
    x: torch.Tensor, group: int | None, col_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel of `quantize_activations` (rows x groups programs; CUDA, or Triton's interpreter)."""
    import triton

    from pdserve.engine.quant.fp8_act_quant import act_quant_kernel

    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    span = k if group is None else group
    g = -(-k // span)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    buf = torch.empty(g, m, dtype=torch.float32, device=x.device) if col_major else None
    scale = buf.t() if buf is not None else torch.empty(m, g, dtype=torch.float32, device=x.device)  # [M, G]
    if m:
        block = min(triton.next_power_of_2(span), ACT_QUANT_ONE_PASS)
        act_quant_kernel[(m, g)](
            x, q, scale, m, k, x.stride(0), AMAX_FLOOR, SPAN=span, BLOCK=block, COL_MAJOR=col_major,
            num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return q, scale


def quantize_activations_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] with one float32 scale [] (a checkpoint's input_scale) -> e4m3 [M, K] (torch ops; capturable)."""
    return _to_fp8(x, scale)
