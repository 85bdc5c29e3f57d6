"""`pdserve up --model A --model B`: each `--model` is served under its directory (or hub id) name, the first one
being the router's own; two models under one name are refused before anything starts."""

from __future__ import annotations

import shutil

import pytest

from pdserve.cli.up import _served_models, up_parser
from pdserve.models.checkpoints import build_checkpoint


def test_model_repeats():
    assert up_parser().parse_args(["--model", "a", "--model", "b"]).model == ["a", "b"]
    assert up_parser().parse_args([]).model is None  # $PDSERVE_MODEL, else the demo model


def test_each_model_is_served_under_its_name(tmp_path):
    a = build_checkpoint(tmp_path / "alpha", arch="llama", seed=1)
    b = build_checkpoint(tmp_path / "beta", arch="qwen2", seed=2)
    assert _served_models([str(a), str(b)]) == [("alpha", str(a)), ("beta", str(b))]
    shutil.copytree(a, tmp_path / "other" / "alpha")
    with pytest.raises(ValueError, match="one name: alpha, alpha"):
        _served_models([str(a), str(tmp_path / "other" / "alpha")])
    with pytest.raises(ValueError, match="no such model directory"):
        _served_models([str(a), str(tmp_path / "missing")])
