"""One logical KV page (a layer range, K and V) in transit between engines, dense or quantized (int8 | fp8).

Byte cost per (token, kv_head), head_dim D, group g, model dtype of b bytes per element:
    dense:        D * b
    int8 sym:     D + 2 * D / g            (int8 values + one fp16 scale per group)
    int8 asym:    D + 4 * D / g            (+ one fp16 zero point per group)
    fp8:          D + 2 * D / g            (e4m3 values + one fp16 scale per group; the engine uses g = D)
e.g. D=128, g=64 vs bf16 (256 B): sym 132 B (ratio 0.516), asym 136 B (ratio 0.531); fp8 g=128: 130 B (0.508).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from pdserve.kv.quant import dequantize, quantize


@dataclass
class PagePayload:
    page_index: int  # logical page index in the sequence
    num_tokens: int  # valid tokens (<= page_size)
    layer_start: int
    data: torch.Tensor  # [2, layers, num_tokens, kv_heads, head_dim] int8 | float8_e4m3fn | model dtype (K=0, V=1)
    scales: torch.Tensor | None  # [2, layers, num_tokens, kv_heads, head_dim // group_size] float16
    zeros: torch.Tensor | None  # same shape as scales, asymmetric only
    group_size: int = 0  # 0 for unquantized

    @property
    def layer_count(self) -> int:
        return self.data.shape[1]

    @property
    def quantized(self) -> bool:
        return self.group_size > 0

    @property
    def nbytes(self) -> int:
        """Payload bytes: data + scales + zeros (what goes on the wire, headers excluded)."""
        n = self.data.numel() * self.data.element_size()
        for t in (self.scales, self.zeros):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


def quantize_payload(
    dense: PagePayload, group_size: int, asymmetric: bool, dtype: torch.dtype = torch.int8
) -> PagePayload:
    """Dense payload (model dtype) -> int8 (or float8_e4m3fn) payload with per-group fp16 scales (+ zeros)."""
    if dense.quantized:
        raise ValueError("payload is already quantized")
    q, scales, zeros = quantize(dense.data, group_size, asymmetric, dtype)
    return replace(dense, data=q, scales=scales, zeros=zeros, group_size=group_size)


def dequantize_payload(p: PagePayload, dtype: torch.dtype) -> PagePayload:
    """Quantized payload -> dense payload of `dtype`; a dense payload is just cast to `dtype`."""
    if not p.quantized:
        data = p.data.to(dtype)
    else:
        if p.scales is None:
            raise ValueError("quantized payload has no scales")
        data = dequantize(p.data, p.scales, p.zeros, p.group_size, dtype)
    return replace(p, data=data, scales=None, zeros=None, group_size=0)


class CachedUpload(NamedTuple):
    """Whole pages stacked page-major in one format, on the engine's device: the copy a cached prefix's import
    made, in its own (stored) format. data [N, 2, layers, page_size, kv_heads, head_dim], scales / zeros
    [N, 2, layers, page_size, kv_heads, head_dim // group] float16 or None."""

    data: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
