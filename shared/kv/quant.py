"""Group-wise int8 and fp8 (e4m3fn) quantization of KV tensors along the last dim (head_dim).

Symmetric:  scale = absmax / 127,        q = round(x / scale)              in [-127, 127],
            x' = q * scale.
Asymmetric: scale = (max - min) / 255,   q = round((x - zero) / scale) - 128 in [-128, 127],
            zero = min,                  x' = (q + 128) * scale + zero.

Scales and zeros are stored as float16. Quantization uses the *fp16-rounded* scale and zero (the scale
rounded up, the zero rounded down), so every value lies inside the representable grid and the
reconstruction error is at most scale/2 (plus float32 arithmetic error), where `scale` is the stored fp16
scale. A group with zero range gets scale 1 and dequantizes to its constant exactly (if the constant is
representable in fp16: the zero point, or 0 in symmetric mode).
fp8 (e4m3fn, symmetric only): scale = absmax / 448 (rounded up to fp16, 0 -> 1), q = fp8(x / scale) (round to
nearest even; |x / scale| <= 448 by construction), x' = q * scale. e4m3 keeps 3 mantissa bits, so the error is
relative (<= 2**-4 of |x| for values above the subnormal range, 2**-10 * scale below it) rather than scale/2.

Inputs are expected inside the fp16 range (|x| <= 65504, true of any model's K/V): scales are clamped to
it, and an asymmetric zero point below -65504 is clamped too (values under it then saturate).

The implementation is plain torch and vectorized, so it runs on any device without host syncs. It is the
reference: the GPU engine's Triton kernels (`pdserve.engine.kernels.kv_quant`, chosen by
`pdserve.engine.kernel_choice`) are bit-identical to it. This package never imports the engine.
"""

from __future__ import annotations

import torch

FP16_MAX = 65504.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8 = torch.float8_e4m3fn


def _check_group(head_dim: int, group_size: int) -> None:
    if group_size <= 0 or head_dim % group_size != 0:
        raise ValueError(f"head_dim {head_dim} is not divisible by group_size {group_size}")


def _fp16_round_up(v: torch.Tensor) -> torch.Tensor:
    """Smallest float16 >= v, for finite v in [0, FP16_MAX] (float32 in, float16 out)."""
    h = v.to(torch.float16)
    bits = h.view(torch.int16)
    # For non-negative halves, bits + 1 is the next representable value up.
    return torch.where(h.float() < v, (bits + 1).view(torch.float16), h)


def _fp16_round_down(v: torch.Tensor) -> torch.Tensor:
    """Largest float16 <= v, for finite v in [-FP16_MAX, FP16_MAX] (float32 in, float16 out)."""
    h = v.to(torch.float16)
    bits = h.view(torch.int16)
    # Sign-magnitude: moving down is bits - 1 for positives and bits + 1 for negatives (incl. -0.0).
    # A +0.0 that is > v cannot happen: a negative v rounds to -0.0 or below.
    down = torch.where(bits < 0, bits + 1, bits - 1).view(torch.float16)
    return torch.where(h.float() > v, down, h)


def quantize(
    x: torch.Tensor, group_size: int, asymmetric: bool, dtype: torch.dtype = torch.int8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [..., D] (any float dtype) -> q [..., D] of `dtype` (int8 | float8_e4m3fn), scales fp16 [..., D // g],
    zeros fp16 [..., D // g] | None (asymmetric int8 only).

    Raises ValueError if D is not divisible by group_size, or for asymmetric fp8 or another dtype.
    """
    _check_group(x.shape[-1], group_size)
    d = x.shape[-1]
    g = x.float().reshape(*x.shape[:-1], d // group_size, group_size)  # [..., G, g]
    if dtype == FP8:
        if asymmetric:
            raise ValueError("fp8 KV quantization is symmetric only")
        return (*_quantize_fp8(g), None)
    if dtype != torch.int8:
        raise ValueError(f"quantized KV dtype must be int8 or float8_e4m3fn, got {dtype}")
    lo, hi = torch.aminmax(g, dim=-1)  # [..., G] each
    if asymmetric:
        zero = _fp16_round_down(lo.clamp_(-FP16_MAX, FP16_MAX))  # fp16, <= every value of the group
        scale = _fp16_round_up(((hi - zero.float()) / 255.0).clamp_(max=FP16_MAX))
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # zero range -> exact constant
        q = (g - zero.float()[..., None]).div_(scale.float()[..., None]).round_().clamp_(0, 255).sub_(128)
    else:
        absmax = torch.maximum(hi, lo.neg_())  # [..., G]
        scale = _fp16_round_up((absmax / 127.0).clamp_(max=FP16_MAX))
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # all zeros -> q = 0, exact
        zero = None
        q = (g / scale.float()[..., None]).round_().clamp_(-127, 127)
    return q.to(torch.int8).reshape(x.shape), scale, zero


def _quantize_fp8(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g float32 [..., G, gs] -> q float8_e4m3fn [..., G * gs], scales fp16 [..., G]."""
    absmax = g.abs().amax(dim=-1)  # [..., G]
    scale = _fp16_round_up((absmax / FP8_MAX).clamp_(max=FP16_MAX))
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # all zeros -> q = 0, exact
    q = (g / scale.float()[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*g.shape[:-2], -1), scale


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q int8 | float8_e4m3fn [..., D], scales/zeros fp16 [..., D // g] -> x' [..., D] of `dtype` (computed in
    float32; the products are exact)."""
    d = q.shape[-1]
    _check_group(d, group_size)
    if q.dtype not in (torch.int8, FP8):
        raise ValueError(f"q must be int8 or float8_e4m3fn, got {q.dtype}")
    if q.dtype == FP8 and zeros is not None:
        raise ValueError("fp8 KV has no zero points")
    if scales.shape != (*q.shape[:-1], d // group_size):
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match q {tuple(q.shape)} / {group_size}")
    g = q.float().reshape(*q.shape[:-1], d // group_size, group_size)  # [..., G, g]
    s = scales.float()[..., None]  # [..., G, 1]
    if zeros is None:
        x = g.mul_(s)
    else:
        x = torch.addcmul(zeros.float()[..., None] + 128.0 * s, g, s)  # (q + 128) * s + zero
    return x.reshape(q.shape).to(dtype)
