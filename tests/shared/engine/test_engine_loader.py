"""Loader (configs, fingerprint, RoPE), engine config resolution, and the KV pools as units."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve.engine.config import EngineConfig, resolve_dtype
from pdserve.engine.kv_cache import KVCache, QuantizedKVCache
from pdserve.engine.loader import model_fingerprint, parse_model_config
from pdserve.engine.model import rope_inv_freq
from pdserve.kv.payload import PagePayload


def edited_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_parse_configs(checkpoint):
    q = parse_model_config(checkpoint("qwen2"))
    assert (q.arch, q.qkv_bias, q.attention_bias, q.tie_word_embeddings) == ("qwen2", True, False, True)
    assert q.rope_theta == 1_000_000.0 and q.rope_scaling is None and q.eos_token_ids == [2]
    v = parse_model_config(checkpoint("llama_variant"))
    assert (v.head_dim, v.qkv_bias, v.attention_bias, v.mlp_bias) == (8, True, True, True)
    assert v.rope_scaling["rope_type"] == "llama3" and v.rope_scaling["factor"] == 8.0
    m = parse_model_config(checkpoint("mistral"))
    assert (m.arch, m.num_kv_heads, m.head_dim, m.bos_token_id) == ("mistral", 2, 16, 1)


def test_generation_config_eos_and_old_rope_format(checkpoint, tmp_path):
    d = edited_copy(
        checkpoint("llama"),
        tmp_path / "m",
        rope_parameters=None,
        rope_theta=5000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    c = parse_model_config(d)
    assert c.eos_token_ids == [2, 4]
    assert c.rope_theta == 5000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_unsupported_architecture_and_sliding_window(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="unsupported architecture"):
        parse_model_config(edited_copy(checkpoint("llama"), tmp_path / "a", architectures=["GPT2LMHeadModel"]))
    with pytest.raises(NotImplementedError, match="sliding_window"):
        parse_model_config(edited_copy(checkpoint("mistral"), tmp_path / "b", sliding_window=256))
    parse_model_config(edited_copy(checkpoint("mistral"), tmp_path / "c", sliding_window=4096))  # >= max: fine
    with pytest.raises(NotImplementedError, match="rope"):
        parse_model_config(
            edited_copy(
                checkpoint("llama"),
                tmp_path / "d",
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
            )
        )


def test_fingerprint(checkpoint, tmp_path):
    a = model_fingerprint(checkpoint("llama"))
    assert a == model_fingerprint(checkpoint("llama")) and len(a) == 32
    assert a != model_fingerprint(checkpoint("mistral"))  # other weights (same seed, different config)
    d = tmp_path / "w"
    shutil.copytree(checkpoint("llama"), d)
    assert model_fingerprint(d) == a  # location-independent
    (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text())))
    assert model_fingerprint(d) != a  # config bytes count
    shutil.copy(checkpoint("llama") / "config.json", d / "config.json")
    st = d / "model.safetensors"
    raw = bytearray(st.read_bytes())
    raw[-100] ^= 0xFF  # one byte in the last sample window
    st.write_bytes(bytes(raw))
    assert model_fingerprint(d) != a


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, head_dim=128, rope_parameters=rope)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, {k: v for k, v in rope.items() if k != "rope_theta"})
    assert torch.equal(ours, ref.float())


def test_engine_config_validation_and_dtype():
    for bad in (dict(page_size=0), dict(kv_dtype="fp4"), dict(attention_backend="xformers"), dict(num_pages=-1)):
        with pytest.raises(ValueError):
            EngineConfig(model_dir="x", **bad).validate()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, "bfloat16") == torch.float32
    assert resolve_dtype("auto", cuda, "bfloat16") == torch.bfloat16
    assert resolve_dtype("float16", cpu, None) == torch.float16


@pytest.mark.parametrize(
    "storage, asym", [(None, False), (torch.int8, False), (torch.int8, True), (torch.float8_e4m3fn, False)]
)
def test_kv_pool_write_read_gather_scatter_import(storage, asym):
    L, P, ps, H, D = 2, 6, 4, 2, 16
    cpu = torch.device("cpu")
    pool = (
        QuantizedKVCache(L, P, ps, H, D, torch.float32, cpu, 8, asym, storage=storage)
        if storage is not None
        else KVCache(L, P, ps, H, D, torch.float32, cpu)
    )
    k, v = torch.randn(6, H, D), torch.randn(6, H, D)
    table = [4, 1]  # logical pages 0, 1 -> physical 4, 1
    slots = torch.tensor([4 * ps + i for i in range(4)] + [1 * ps + i for i in range(2)])
    pool.write(1, slots, k, v)
    rk, rv = pool.read(1, table, 6)
    # int8: |err| <= scale / 2 = absmax / 254; fp8 e4m3: relative 2**-4 (+ subnormals near 0)
    tol = {None: 0.0, torch.int8: 0.05, torch.float8_e4m3fn: 0.07 * max(k.abs().max(), v.abs().max())}[storage]
    assert (rk - k).abs().max() <= tol and (rv - v).abs().max() <= tol
    gk, _ = pool.gather(1, slots[[5, 0]])
    assert torch.equal(gk, rk[[5, 0]])
    for quantized, dtype in ((False, None), (True, None), (True, torch.float8_e4m3fn)):
        g = 8 if quantized else 0
        data, scales, zeros = pool.gather_pages([1], [2], quantized, g, False, dtype)  # physical page 1: 2 tokens
        assert data.shape == (1, 2, L, ps, H, D) and zeros is None and (scales is None) != quantized
        assert data.dtype == (dtype or torch.int8 if quantized else torch.float32)
        assert not data[:, :, :, 2:].view(torch.uint8).any()  # tokens past the page's end are zero
        pool.scatter_pages([3], data, scales, zeros, g)
        k3, v3 = pool.read(1, [3], 2)
        assert (k3 - k[4:6]).abs().max() <= 0.25 and (v3 - v[4:6]).abs().max() <= 0.25
        if storage is not None and quantized and (dtype or torch.int8) == storage:  # own format: straight copies
            again = pool.gather_pages([3], [2], True, 8, asym, dtype)[0]
            assert torch.equal(again.view(torch.uint8), data.view(torch.uint8)) or asym
        # one prompt-cache page (a PagePayload of the first 2 tokens) into physical page 0
        p = PagePayload(1, 2, 0, data[0, :, :, :2], None if scales is None else scales[0, :, :, :2], None, g)
        pool.import_page(0, p)
        k0, v0 = pool.read(1, [0], 2)
        assert (k0 - k[4:6]).abs().max() <= 0.25 and (v0 - v[4:6]).abs().max() <= 0.25
    with pytest.raises(ValueError):
        pool.gather_pages([P], [2], False)
    with pytest.raises(ValueError):
        pool.gather_pages([0], [ps + 1], False)
