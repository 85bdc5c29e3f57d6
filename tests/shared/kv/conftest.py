"""Shared fixtures for pdserve.kv tests: a tiny llama trained once per session (~40 s on 2 CPU cores)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def trained_model_dir(tmp_path_factory) -> Path:
    from pdserve.models.train_tiny import train_tiny_checkpoint

    # training is matmul-bound: two threads (the CI box's cores), whatever an earlier conftest set for the whole
    # process (tests/shared/engine's sets one, for its tiny ops); a fixed count, so the weights do not depend on the
    # machine's core count
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return train_tiny_checkpoint(tmp_path_factory.mktemp("tiny-trained"), seconds=45, seed=0)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def real_kv(trained_model_dir) -> torch.Tensor:
    """[2, layers, T=512, kv_heads, head_dim] float32 K/V of the trained model on held-out text."""
    from pdserve.models.train_tiny import capture_kv, split_corpus

    return capture_kv(trained_model_dir, split_corpus()[1], max_tokens=512)
