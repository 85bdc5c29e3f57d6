"""Shared fixtures: tiny real HF checkpoints (built once per session per variant) and engine/HF factories."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.models.checkpoints import build_checkpoint

torch.set_num_threads(1)  # tiny ops: a 2-thread pool on a shared 2-core box is ~100x slower
sys.path.insert(0, str(Path(__file__).parent))  # engine_testutil (pytest runs with --import-mode=importlib)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# name -> (arch, build overrides). "llama_variant": head_dim != hidden/heads, q/k/v/o + MLP bias, llama3 RoPE.
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral": ("mistral", {}),
    "llama_variant": (
        "llama",
        dict(seed=1, head_dim=8, attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE),
    ),
    "qwen3": ("qwen3", {}),  # per-head q/k RMSNorm
    "llama_hd64": ("llama", dict(head_dim=64)),  # a head_dim FlashAttention-3 kernels are built for (GPU test)
    "llama_hd128": ("llama", dict(head_dim=128)),  # the int8 byte-plane decode kernels' head_dim (GPU test)
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> model dir, built on first use and reused for the session."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            arch, kw = VARIANTS[name]
            kw = dict(kw)
            seed = kw.pop("seed", 0)
            built[name] = build_checkpoint(tmp_path_factory.mktemp(name), arch=arch, seed=seed, **kw)
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    """hf_model(name) -> transformers AutoModelForCausalLM in float32 (EOS never stops generate())."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(name: str):
        if name not in cache:
            m = AutoModelForCausalLM.from_pretrained(str(checkpoint(name)), dtype=torch.float32).eval()
            m.generation_config.eos_token_id = None  # compare full lengths, like ignore_eos
            cache[name] = m
        return cache[name]

    return get


@pytest.fixture(scope="session")
def make_engine(checkpoint):
    """make_engine(name, **EngineConfig overrides) -> LLMEngine on CPU/fp32 with small pages and chunks."""

    def make(name: str = "llama", **kw) -> LLMEngine:
        cfg = dict(
            page_size=4, chunk_size=8, num_pages=128, max_num_seqs=16, device="cpu", dtype="float32", kv_dtype="auto"
        )
        cfg.update(kw)
        return LLMEngine(EngineConfig(model_dir=str(checkpoint(name)), **cfg))

    return make


@pytest.fixture(scope="session")
def llama_engine(make_engine):
    """One shared engine for tests that leave it idle and empty (they must not change its config)."""
    return make_engine("llama")


@pytest.fixture(scope="module")
def prefill_engine(make_engine):
    """A module's prefill side of a disaggregated pair (test_engine_disagg.py, test_engine_resume.py)."""
    return make_engine("llama")


@pytest.fixture(scope="module")
def decode_engine(make_engine):
    """A module's decode side of a disaggregated pair."""
    return make_engine("llama")
