"""PagePayload byte accounting and quantize/dequantize of whole pages.

Overhead per (token, kv_head) for head_dim 128, group 64:
    bf16 dense 256 B; int8 sym 128 + 2 fp16 scales = 132 B (ratio 0.516); asym + 2 fp16 zeros = 136 B (0.531).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.payload import PagePayload, dequantize_payload, quantize_payload


def dense_page(
    layers: int = 3, tokens: int = 16, heads: int = 2, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16
) -> PagePayload:
    g = torch.Generator().manual_seed(0)
    data = torch.randn(2, layers, tokens, heads, head_dim, generator=g).to(dtype)
    return PagePayload(page_index=5, num_tokens=tokens, layer_start=1, data=data, scales=None, zeros=None)


@pytest.mark.parametrize("asymmetric,per_token_head,ratio", [(False, 132, 0.516), (True, 136, 0.531)])
def test_nbytes_head_dim_128_group_64(asymmetric, per_token_head, ratio):
    dense = dense_page()
    token_heads = 2 * 3 * 16 * 2  # K/V x layers x tokens x heads
    assert dense.nbytes == token_heads * 256
    q = quantize_payload(dense, 64, asymmetric)
    assert q.nbytes == token_heads * per_token_head
    assert round(q.nbytes / dense.nbytes, 3) == ratio
    assert q.scales.shape == (2, 3, 16, 2, 2) and q.scales.dtype == torch.float16
    assert (q.zeros is not None) == asymmetric


def test_quantize_dequantize_payload_roundtrip():
    dense = dense_page(dtype=torch.float32)
    q = quantize_payload(dense, 32, False)
    assert (q.page_index, q.num_tokens, q.layer_start, q.group_size, q.layer_count) == (5, 16, 1, 32, 3)
    assert q.quantized and q.data.dtype == torch.int8
    back = dequantize_payload(q, torch.bfloat16)
    assert not back.quantized and back.data.dtype == torch.bfloat16 and back.scales is None
    assert (back.data.float() - dense.data).abs().max() < 0.05
    assert dequantize_payload(dense, torch.float16).data.dtype == torch.float16
    with pytest.raises(ValueError):
        quantize_payload(q, 32, False)
