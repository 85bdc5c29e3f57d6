"""deploy/prepare_model.py: a mounted model is used as is, an empty volume gets the built model (config.json
last), an interrupted copy is redone, and a folder that is not a model is never written into."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy/prepare_model.py"


@pytest.fixture(scope="module")
def prep():
    spec = importlib.util.spec_from_file_location("prepare_model", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def built(tmp_path: Path) -> Path:
    src = tmp_path / "built"
    src.mkdir()
    for name, data in {"config.json": "{}", "tokenizer.json": "{}", "model.safetensors": "w" * 100}.items():
        (src / name).write_text(data)
    return src


def test_mounted_model_is_left_alone(prep, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text('{"mine": 1}')
    assert prep.prepare(target, build=lambda: pytest.fail("built"), say=lambda _: None) == target
    assert (target / "config.json").read_text() == '{"mine": 1}' and not (target / prep.MARKER).exists()


def test_empty_volume_gets_the_model_config_last(prep, tmp_path, monkeypatch):
    target = tmp_path / "model"
    target.mkdir()
    order = []
    real_replace = prep.os.replace
    monkeypatch.setattr(prep.os, "replace", lambda a, b: (order.append(Path(b).name), real_replace(a, b)))
    prep.prepare(target, build=lambda: built(tmp_path), say=lambda _: None)
    assert order[-1] == "config.json" and sorted(order) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (target / "model.safetensors").read_text() == "w" * 100
    assert not list(target.glob(".partial-*"))


def test_interrupted_copy_is_redone(prep, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / prep.MARKER).write_text("")
    (target / ".partial-model.safetensors").write_text("half")
    (target / "tokenizer.json").write_text("{}")
    prep.prepare(target, build=lambda: built(tmp_path), say=lambda _: None)
    assert (target / "config.json").exists() and (target / "model.safetensors").read_text() == "w" * 100


def test_foreign_folder_is_refused(prep, tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "notes.txt").write_text("not a model")
    with pytest.raises(SystemExit, match="not a model directory"):
        prep.prepare(target, build=lambda: pytest.fail("built"), say=lambda _: None)
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]


def test_main_builds_the_demo_model_into_the_env_dir(prep, tmp_path, monkeypatch):
    import pdserve.models.demo as demo

    monkeypatch.setenv("PDSERVE_MODEL_DIR", str(tmp_path / "vol"))
    monkeypatch.setattr(demo, "ensure_demo_model", lambda say: built(tmp_path))
    assert prep.main() == 0 and (tmp_path / "vol/config.json").exists()
