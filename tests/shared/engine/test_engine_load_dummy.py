"""`load_format="dummy"`: an engine built from a directory holding only config.json and a tokenizer, with random
weights (bf16/fp32, FP8 in the config's checkpoint layout through the CPU's dequantized path, online FP8)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_testutil import random_prompt

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.loader import iter_dummy_weights, parse_model_config
from pdserve.engine.quant.fp8_convert import quantization_config
from pdserve.engine.sampling import SamplingParams

KW = dict(page_size=4, chunk_size=8, num_pages=64, max_num_seqs=4, device="cpu", dtype="float32", kv_dtype="auto")
PROMPTS = [random_prompt(n, seed=n) for n in (3, 11)]


def config_only(src: Path, dst: Path, fp8: str | None = None) -> Path:
    """`src`'s config.json (with an FP8 quantization_config of format `fp8`) and tokenizer files, no weights."""
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, dst / f.name)
    if fp8 is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = quantization_config(fp8)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def greedy(engine: LLMEngine, n: int = 6) -> list[list[int]]:
    return engine.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("name", ["llama", "llama_variant"])
def test_config_only_dir_loads_and_generates(checkpoint, tmp_path, name):
    d = config_only(checkpoint(name), tmp_path / "m")
    with pytest.raises(FileNotFoundError, match="safetensors"):  # the default reads the checkpoint's weights
        LLMEngine(EngineConfig(model_dir=str(d), **KW))
    a = LLMEngine(EngineConfig(model_dir=str(d), load_format="dummy", **KW))
    out = greedy(a)
    assert [len(o) for o in out] == [6, 6]
    b = LLMEngine(EngineConfig(model_dir=str(d), load_format="dummy", **KW))
    assert greedy(b) == out  # one seed: the same config gives the same weights
    assert a.fingerprint == b.fingerprint
    bf16 = LLMEngine(EngineConfig(model_dir=str(d), load_format="dummy", **{**KW, "dtype": "bfloat16"}))
    assert next(bf16.runner.model.parameters()).dtype == torch.bfloat16
    assert len(greedy(bf16, 3)[0]) == 3


@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
def test_dummy_fp8_layouts_on_the_dequantized_cpu_path(checkpoint, tmp_path, fmt):
    d = config_only(checkpoint("llama"), tmp_path / "m", fp8=fmt)
    mc = parse_model_config(d)
    tensors = dict(iter_dummy_weights(mc, torch.device("cpu"), torch.float32))
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    scale_name = {"block": "weight_scale_inv", "channel": "weight_scale", "tensor": "weight_scale"}[fmt]
    scale = tensors[f"model.layers.0.self_attn.q_proj.{scale_name}"]
    n, k = q.shape
    assert q.dtype == torch.float8_e4m3fn and tensors["lm_head.weight"].dtype == torch.float32
    assert scale.shape == {"block": (-(-n // 128), -(-k // 128)), "channel": (n, 1), "tensor": (1,)}[fmt]
    assert ("model.layers.0.self_attn.q_proj.input_scale" in tensors) == (fmt == "tensor")
    assert 0.5 < (q.float() * scale.flatten()[0]).std().item() * k**0.5 < 2  # dequantized ~ N(0, 1/K)
    e = LLMEngine(EngineConfig(model_dir=str(d), load_format="dummy", **KW))
    w = e.runner.model.model.layers[0].self_attn.qkv_proj.weight  # CPU: dequantized at load, fp32 [N, K]
    codes = w[:n] / scale.flatten()[0]
    assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes)  # every value an e4m3 code times the scale
    assert torch.equal(codes, q.float())
    assert [len(o) for o in greedy(e)] == [6, 6]


def test_dummy_with_online_fp8(checkpoint, tmp_path):
    d = config_only(checkpoint("llama"), tmp_path / "m")
    plain = LLMEngine(EngineConfig(model_dir=str(d), load_format="dummy", **KW))
    fp8 = LLMEngine(EngineConfig(model_dir=str(d), load_format="dummy", quantization="fp8", **KW))
    w, wq = (e.runner.model.model.layers[1].mlp.down_proj.weight for e in (plain, fp8))
    assert not torch.equal(w, wq) and torch.allclose(w, wq, rtol=0.07, atol=1e-6)  # e4m3 rounding, 3 mantissa bits
    assert plain.fingerprint != fp8.fingerprint
    assert [len(o) for o in greedy(fp8)] == [6, 6]


def test_bad_load_format():
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(model_dir="x", load_format="random").validate()
