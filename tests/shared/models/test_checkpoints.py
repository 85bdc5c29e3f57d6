"""The demo/test checkpoint builder writes real HF checkpoints that load through transformers."""
from pdserve.models.checkpoints import ensure_demo_model, read_config


def test_demo_model_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    path = ensure_demo_model()
    assert path.parent == tmp_path and (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    cfg = read_config(path)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 512
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(path))
    assert max(tok("hello world").input_ids) < cfg["vocab_size"] and len(tok) == cfg["vocab_size"]
