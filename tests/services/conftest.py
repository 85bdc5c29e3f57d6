"""Makes services_testutil importable from every test under tests/services, and gives this test process a
stack-wide internal token: every service a test starts inherits it ($PDSERVE_INTERNAL_TOKEN), and the tests' own
internal channels (`pdserve.server.grpc_util.channel`) carry it, as the processes of one stack do. Fixtures: the
tiny llama checkpoint of the end-to-end tests (`model_dir`, built once per session; a module may define its own)
and its HF reference model (`hf_model`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.auth import new_token

sys.path.insert(0, str(Path(__file__).parent))  # services_testutil (pytest runs with --import-mode=importlib)
os.environ.setdefault("PDSERVE_INTERNAL_TOKEN", new_token())


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random llama checkpoint (seed 1) that the end-to-end tests serve."""
    return build_checkpoint(tmp_path_factory.mktemp("e2e-llama") / "ckpt", arch="llama", seed=1)


@pytest.fixture(scope="session")
def hf_model(model_dir):
    """`model_dir` in transformers: the reference that greedy outputs with full-precision KV must equal."""
    from pdserve.testing.hf_reference import load_hf_model  # transformers: only for the tests that use it

    return load_hf_model(model_dir)
