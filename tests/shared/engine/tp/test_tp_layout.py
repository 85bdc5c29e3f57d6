"""The TP layout's integers: head, KV head (split or replicated), vocabulary and FFN ranges, and its errors."""

from __future__ import annotations

import pytest

from pdserve.engine.loader import ModelConfig
from pdserve.engine.quant.fp8_checkpoint import Fp8Scheme
from pdserve.engine.tp.layout import local_config, make_layout


def config(heads: int, kv_heads: int, vocab: int = 1000, ffn: int = 512, block: bool = False) -> ModelConfig:
    scheme = Fp8Scheme(weights="block", block_size=(128, 128), source="fp8") if block else None
    return ModelConfig(
        arch="llama", vocab_size=vocab, hidden_size=heads * 16, num_layers=2, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=16, intermediate_size=ffn, rms_norm_eps=1e-6, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False,
        quantization=scheme,
    )  # fmt: skip


def kv_lists(heads: int, kv_heads: int, tp: int) -> list[list[int]]:
    return [list(r.kv_heads) for r in make_layout(config(heads, kv_heads), tp).ranks]


def check_local_heads_read_their_kv(heads: int, kv_heads: int, tp: int) -> None:
    """Every local query head's local KV head (uniform local group) is its global query head's KV head."""
    layout = make_layout(config(heads, kv_heads), tp)
    group = heads // kv_heads
    for r in layout.ranks:
        local_group = r.num_q_heads // r.num_kv_heads
        assert r.num_q_heads % r.num_kv_heads == 0 and r.num_kv_heads == layout.kv_per_rank
        for j in range(r.num_q_heads):
            assert r.kv_heads[j // local_group] == (r.q_heads[0] + j) // group


def test_kv_heads_split_when_tp_divides_them():
    assert kv_lists(32, 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert not make_layout(config(32, 8), 4).replicated_kv


def test_kv_heads_replicated_when_tp_exceeds_them():
    assert kv_lists(32, 2, 8) == [[0]] * 4 + [[1]] * 4
    assert make_layout(config(32, 2), 8).replicated_kv


def test_kv_heads_that_do_not_divide_are_held_twice():
    assert kv_lists(6, 2, 3) == [[0, 0], [0, 1], [1, 1]]
    assert kv_lists(12, 4, 3) == [[0, 0, 0, 1], [1, 1, 2, 2], [2, 3, 3, 3]]  # groups of 3 over ranks of 4 heads


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(32, 8, 2), (32, 8, 8), (32, 1, 4), (6, 2, 3), (12, 4, 3),
                                                       (12, 4, 6), (24, 6, 4), (14, 2, 7), (4, 4, 1)])  # fmt: skip
def test_each_query_head_reads_its_kv_head(heads, kv_heads, tp):
    check_local_heads_read_their_kv(heads, kv_heads, tp)


def test_query_heads_contiguous():
    layout = make_layout(config(8, 2), 4)
    assert [r.q_heads for r in layout.ranks] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_vocab_shards_padded_and_the_last_short():
    layout = make_layout(config(6, 2, vocab=509), 3)
    assert layout.vocab_shard == 170
    assert [r.vocab for r in layout.ranks] == [(0, 170), (170, 340), (340, 509)]


def test_ffn_ranges_as_even_as_possible():
    assert [r.ffn for r in make_layout(config(6, 2, ffn=128), 3).ranks] == [(0, 42), (42, 85), (85, 128)]


def test_ffn_ranges_in_whole_fp8_blocks():
    layout = make_layout(config(8, 8, ffn=640, block=True), 2)  # 5 blocks of 128: 2 and 3
    assert [r.ffn for r in layout.ranks] == [(0, 256), (256, 640)]
    with pytest.raises(ValueError, match="128-column FP8 blocks"):
        make_layout(config(8, 8, ffn=256, block=True), 4)


def test_local_config():
    cfg = config(6, 2, vocab=509, ffn=128)
    local = local_config(cfg, make_layout(cfg, 3).rank(2))
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 2, 43, 169)
    assert (local.hidden_size, local.head_dim) == (cfg.hidden_size, cfg.head_dim)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "match"),
    [(6, 2, 4, "not divisible by tensor_parallel_size 4"), (6, 4, 2, "not a multiple of num_key_value_heads"),
     (8, 2, 0, "must be in 1..64"), (8, 2, 65, "must be in 1..64")],
)  # fmt: skip
def test_errors(heads, kv_heads, tp, match):
    with pytest.raises(ValueError, match=match):
        make_layout(config(heads, kv_heads), tp)
    with pytest.raises(ValueError, match="outside the TP group"):
        make_layout(config(8, 2), 2).rank(2)
