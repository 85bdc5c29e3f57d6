"""bench/fp8_gemm_sweep.py's table (fp8_block_gemm.SKINNY_CONFIGS) from measured rows, and the choice it feeds:
`skinny_tuple` (table, rule, cuBLAS) and `config_from_tuple` (split-K, row tiles grouped)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from fp8_gemm_sweep import skinny_table

from pdserve.engine.quant import fp8_block_gemm as G


def row(m: int, proj: dict) -> dict:
    return {"model": "8b", "m": m, "proj": proj}


def test_the_table_takes_triton_only_where_it_beat_cublas_by_more_than_3_percent():
    c = (64, 64, 128, 4, 6, 2, 0)
    rows = [row(128, {
        "qkv": {"cublas_channel": 1.0, f"triton_channel {c}": 0.96, "cublas_block": 1.0, f"triton_block {c}": 0.98},
        "o": {"cublas_channel": 1.0, f"triton_channel {c}": 0.98, "cublas_block": 1.0, "triton_block default": 0.5},
        "gate_up": {"cublas_channel": 1.0, "triton_channel default": 1.2},
        "down": {"triton_channel default": 0.7},  # no cuBLAS figure (refused): Triton
    })]  # fmt: skip
    table = skinny_table(rows)
    assert f"(True, 128, 6144, 4096): {c}," in table
    assert "(False, 128, 6144, 4096): None," in table  # 2% faster: within the margin
    assert "(True, 128, 4096, 4096): None," in table
    # "default": the config the library gave the run, named as a tuple
    assert f"(False, 128, 4096, 4096): {G.skinny_tuple(128, 4096, 4096, False) or G.SKINNY_RULE_BLOCK}," in table
    assert "(True, 128, 28672, 4096): None," in table
    assert f"(True, 128, 4096, 14336): {G.skinny_tuple(128, 4096, 14336, True)}," in table


def test_skinny_choice_table_rule_and_cublas():
    assert G.skinny_tuple(16, 4096, 4096, True) is None  # the GEMV's rows
    assert G.skinny_tuple(257, 4096, 4096, True) is None  # prefill: cuBLAS / the prefill tiles
    assert G.skinny_tuple(100, 28672, 4096, True) is None  # the table: cuBLAS's gate_up at 128 rows
    assert G.skinny_tuple(100, 6144, 4096, True) == G.SKINNY_CONFIGS[(True, 128, 6144, 4096)]
    # a shape the table lacks: the rule (per channel up to 64 rows, up to 128 below N = 16384; block up to 32)
    assert G.skinny_tuple(40, 2048, 2048, True) == G.SKINNY_RULE_CHANNEL
    assert G.skinny_tuple(100, 2048, 2048, True) == G.SKINNY_RULE_CHANNEL
    assert G.skinny_tuple(100, 32768, 2048, True) is None
    assert G.skinny_tuple(32, 2048, 2048, False) == G.SKINNY_RULE_BLOCK
    assert G.skinny_tuple(33, 2048, 2048, False) is None
    # where cuBLAS cannot take the shape the Triton GEMM runs the rule's config
    assert G.skinny_config(100, 28672, 4096, True)["BN"] == G.SKINNY_RULE_CHANNEL[1]


def test_config_from_tuple_splits_k_to_fill_the_sms_and_groups_row_tiles():
    cfg = G.config_from_tuple((64, 64, 128, 4, 6, 2, 1), 128, 4096, 14336, sms=132)
    # 2 row tiles x 64 column tiles = 128 programs, 264 wanted: 2 programs along K; both row tiles of a column next
    assert (cfg["GROUP_M"], cfg["split"], cfg["TMA"]) == (2, 2, True)
    assert G.config_from_tuple((64, 128, 128, 4, 4, 2, 0), 32, 28672, 4096, sms=132)["split"] == 1  # 224 tiles
    assert G.config_from_tuple((64, 64, 128, 4, 6, 0, 0), 32, 4096, 4096, sms=132)["split"] == 1  # no split asked
    assert G.counter_slots(G.SKINNY_MAX_ROWS, 4096) >= 4 * 64  # tickets for 4 row tiles x the narrowest columns
