"""A rank's slices of checkpoint tensors: column-parallel rows, row-parallel columns (bias on rank 0 only), vocabulary
rows, replicated KV heads, and FP8 weights whose scales (per channel, per tensor, 128x128 blocks) follow their slice:
each rank's dequantized slice is exactly the slice of the dequantized full weight."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.loader import ModelConfig
from pdserve.engine.quant.fp8_checkpoint import Fp8Scheme
from pdserve.engine.quant.fp8_quant import dequantize_weight, quantize_weight_blocks, quantize_weight_per_channel
from pdserve.engine.tp.layout import make_layout
from pdserve.engine.tp.shard import RankSharder

BLOCK = (128, 128)
P = "model.layers.0."


def config(heads: int, kv_heads: int, head_dim: int, hidden: int, ffn: int, block: bool = False) -> ModelConfig:
    scheme = Fp8Scheme(weights="block", block_size=BLOCK, source="fp8") if block else None
    return ModelConfig(
        arch="qwen2", vocab_size=509, hidden_size=hidden, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=ffn, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False, quantization=scheme,
    )  # fmt: skip


def sharders(cfg: ModelConfig, tp: int) -> list[RankSharder]:
    layout = make_layout(cfg, tp)
    return [RankSharder(cfg, layout, r) for r in range(tp)]


def test_dense_slices_reassemble():
    cfg = config(heads=6, kv_heads=2, head_dim=8, hidden=48, ffn=128)
    g = torch.Generator().manual_seed(0)
    full = {
        f"{P}self_attn.q_proj.weight": torch.randn(48, 48, generator=g),
        f"{P}self_attn.k_proj.weight": torch.randn(16, 48, generator=g),
        f"{P}self_attn.k_proj.bias": torch.randn(16, generator=g),
        f"{P}self_attn.o_proj.weight": torch.randn(48, 48, generator=g),
        f"{P}self_attn.o_proj.bias": torch.randn(48, generator=g),
        f"{P}mlp.up_proj.weight": torch.randn(128, 48, generator=g),
        f"{P}mlp.down_proj.weight": torch.randn(48, 128, generator=g),
        f"{P}input_layernorm.weight": torch.randn(48, generator=g),
        "model.embed_tokens.weight": torch.randn(509, 48, generator=g),
    }
    parts = [{n: s(n, t) for n, t in full.items()} for s in sharders(cfg, 3)]
    cat = lambda name, dim: torch.cat([p[name] for p in parts], dim)  # noqa: E731
    assert torch.equal(cat(f"{P}self_attn.q_proj.weight", 0), full[f"{P}self_attn.q_proj.weight"])
    assert torch.equal(cat(f"{P}mlp.up_proj.weight", 0), full[f"{P}mlp.up_proj.weight"])
    assert torch.equal(cat("model.embed_tokens.weight", 0), full["model.embed_tokens.weight"])
    k = full[f"{P}self_attn.k_proj.weight"]
    assert torch.equal(parts[0][f"{P}self_attn.k_proj.weight"], torch.cat([k[:8], k[:8]]))  # KV heads [0, 0]
    kb = full[f"{P}self_attn.k_proj.bias"]
    assert torch.equal(parts[2][f"{P}self_attn.k_proj.bias"], torch.cat([kb[8:], kb[8:]]))  # KV heads [1, 1]
    for proj, width in (("self_attn.o_proj", 48), ("mlp.down_proj", 128)):
        w = full[f"{P}{proj}.weight"]
        xs = torch.randn(3, width, generator=g)  # row parallel: the ranks' partial sums add up to the projection
        total = sum(xs[:, a:b] @ p[f"{P}{proj}.weight"].T for p, (a, b) in zip(parts, spans(cfg, proj)))
        torch.testing.assert_close(total, xs @ w.T)
    biases = [p[f"{P}self_attn.o_proj.bias"] for p in parts]
    assert torch.equal(biases[0], full[f"{P}self_attn.o_proj.bias"]) and not biases[1].any() and not biases[2].any()
    assert parts[1][f"{P}input_layernorm.weight"] is full[f"{P}input_layernorm.weight"]


def spans(cfg: ModelConfig, proj: str) -> list[tuple[int, int]]:
    layout = make_layout(cfg, 3)
    if proj == "mlp.down_proj":
        return [r.ffn for r in layout.ranks]
    return [(r.q_heads[0] * cfg.head_dim, r.q_heads[1] * cfg.head_dim) for r in layout.ranks]


def test_block_fp8_scales_follow_the_slice():
    cfg = config(heads=4, kv_heads=2, head_dim=128, hidden=256, ffn=640, block=True)
    g = torch.Generator().manual_seed(1)
    shapes = {"self_attn.q_proj": (512, 256), "self_attn.k_proj": (256, 256), "self_attn.o_proj": (256, 512),
              "mlp.gate_proj": (640, 256), "mlp.down_proj": (256, 640)}  # fmt: skip
    for sharder in sharders(cfg, 2):
        layout = sharder.rank
        for proj, (n, k) in shapes.items():
            q, scale = quantize_weight_blocks(torch.randn(n, k, generator=g), BLOCK)
            dense = dequantize_weight(q, scale, BLOCK, torch.float32)
            name = f"{P}{proj}.weight"
            qs, ss = sharder(name, q), sharder(f"{P}{proj}.weight_scale_inv", scale)
            got = dequantize_weight(qs, ss, BLOCK, torch.float32)
            if proj in ("self_attn.o_proj", "mlp.down_proj"):
                a, b = layout.ffn if proj == "mlp.down_proj" else (layout.q_heads[0] * 128, layout.q_heads[1] * 128)
                assert torch.equal(got, dense[:, a:b])
            else:
                rows = {"self_attn.q_proj": (layout.q_heads[0] * 128, layout.q_heads[1] * 128),
                        "self_attn.k_proj": (layout.kv_heads[0] * 128, (layout.kv_heads[0] + 1) * 128),
                        "mlp.gate_proj": layout.ffn}[proj]  # fmt: skip
                assert torch.equal(got, dense[rows[0] : rows[1]])
    assert [s.rank.ffn for s in sharders(cfg, 2)] == [(0, 256), (256, 640)]  # whole blocks; the last one partial


def test_block_fp8_misaligned_slice_is_refused():
    cfg = config(heads=4, kv_heads=4, head_dim=64, hidden=256, ffn=512, block=True)  # a head of 64 rows per rank
    q, scale = quantize_weight_blocks(torch.randn(256, 256), BLOCK)
    with pytest.raises(ValueError, match="q_proj.weight_scale_inv: .* 128-element FP8 block boundaries"):
        sharders(cfg, 4)[1](f"{P}self_attn.q_proj.weight_scale_inv", scale)


def test_channel_fp8_scales():
    cfg = config(heads=4, kv_heads=2, head_dim=8, hidden=32, ffn=64)
    k_full = torch.randn(16, 32)
    q, scale = quantize_weight_per_channel(k_full)  # scale [16]
    o_q, o_scale = quantize_weight_per_channel(torch.randn(32, 32))
    s1 = sharders(cfg, 2)[1]
    assert torch.equal(s1(f"{P}self_attn.k_proj.weight_scale", scale.reshape(16, 1)), scale[8:].reshape(8, 1))
    assert torch.equal(
        dequantize_weight(s1(f"{P}self_attn.k_proj.weight", q), s1(f"{P}self_attn.k_proj.weight_scale", scale), None,
                          torch.float32),
        dequantize_weight(q, scale, None, torch.float32)[8:],
    )  # fmt: skip
    assert s1(f"{P}self_attn.o_proj.weight_scale", o_scale) is o_scale  # output rows stay whole
    assert torch.equal(s1(f"{P}self_attn.o_proj.weight", o_q).view(torch.uint8), o_q[:, 16:].view(torch.uint8))
    per_tensor = torch.tensor(0.5)
    assert s1(f"{P}self_attn.q_proj.weight_scale", per_tensor) is per_tensor
    assert s1(f"{P}self_attn.q_proj.input_scale", per_tensor) is per_tensor
