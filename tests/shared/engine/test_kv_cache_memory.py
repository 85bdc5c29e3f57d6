"""`--kv-cache-memory`: the KV pool sized from a memory budget on CPU as on a GPU; auto on CPU is a small pool."""

from __future__ import annotations

import pytest

from pdserve.engine.config import CPU_KV_CACHE_BYTES, EngineConfig, parse_size
from pdserve.engine.engine import LLMEngine
from pdserve.models.checkpoints import build_checkpoint


def test_sizes_parse_with_binary_units():
    assert parse_size("512MiB") == 512 << 20 and parse_size("2GiB") == 2 << 30
    assert parse_size("1.5g") == 3 << 29 and parse_size("64k") == 64 << 10
    for bad in ("512", "lots", "0MiB", "-1GiB"):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            parse_size(bad)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(model_dir="m", kv_cache_memory="12").validate()
    assert EngineConfig(model_dir="m").kv_cache_bytes() is None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_checkpoint(tmp_path_factory.mktemp("kvmem") / "ckpt", arch="llama", seed=1))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_pool_follows_the_budget(model, kv_dtype):
    engine = LLMEngine(EngineConfig(model_dir=model, device="cpu", kv_dtype=kv_dtype, kv_cache_memory="3MiB"))
    page = engine.runner.page_bytes()
    assert engine.runner.num_pages == (3 << 20) // page > 1
    assert engine.runner.num_pages * page <= 3 << 20


def test_auto_on_cpu_is_capped_by_the_budget_and_the_sequences(model):
    small = LLMEngine(EngineConfig(model_dir=model, device="cpu", max_num_seqs=2))
    per_seq = -(-small.model_config.max_position_embeddings // small.page_size)
    assert small.runner.num_pages == min(2 * per_seq, CPU_KV_CACHE_BYTES // small.runner.page_bytes())
    with pytest.raises(ValueError, match="less than one KV page"):
        LLMEngine(EngineConfig(model_dir=model, device="cpu", kv_cache_memory="1k"))
    pinned = LLMEngine(EngineConfig(model_dir=model, device="cpu", num_pages=7, kv_cache_memory="3MiB"))
    assert pinned.runner.num_pages == 7  # --num-pages wins
