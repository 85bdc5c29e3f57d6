"""The router's per-model state: which model a request names (`resolve`), each model's context loaded from the
directory its instances announced, and the bounded cache of loaded models (least recently used unloaded, its
estimator saved)."""

from __future__ import annotations

import json

import pytest

from pdserve.models.checkpoints import build_checkpoint
from pdserve.router.catalog import (
    AmbiguousModel,
    ModelCatalog,
    ModelUnavailable,
    UnknownModel,
    load_model_context,
    resolve,
)
from pdserve.router.estimator import features


def test_resolve_names_the_choices():
    assert resolve("", {"alpha": ""}) == "alpha"  # one served: the default
    assert resolve("beta", {"alpha": "", "beta": "/b"}) == "beta"
    with pytest.raises(AmbiguousModel, match="several models \\('alpha', 'beta'\\)"):
        resolve("", {"beta": "/b", "alpha": ""})
    with pytest.raises(UnknownModel, match="'gamma' is not served here; served: 'alpha', 'beta'"):
        resolve("gamma", {"alpha": "", "beta": "/b"})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Three tiny checkpoints of different vocabulary sizes and context lengths."""
    base = tmp_path_factory.mktemp("catalog")
    return {
        name: build_checkpoint(base / name, arch=arch, seed=k, vocab_size=vocab, max_position_embeddings=ctx)
        for k, (name, arch, vocab, ctx) in enumerate(
            [("alpha", "llama", 512, 256), ("beta", "qwen2", 384, 128), ("gamma", "llama", 448, 192)]
        )
    }


def load(name: str, path: str, store: str = "memory"):
    ctx = load_model_context(name, path, store, min_samples=1, max_error=1.0, save_interval_s=60)
    ctx.start()
    return ctx


def test_a_context_is_its_models(dirs):
    ctx = load("beta", str(dirs["beta"]))
    assert (ctx.name, ctx.vocab_size, ctx.max_model_len) == ("beta", 384, 128)
    assert ctx.tokenizer("hello world").input_ids  # the model's own tokenizer
    ctx.close()


def test_a_directory_without_a_model_is_unavailable_by_name(tmp_path):
    with pytest.raises(ModelUnavailable, match="model 'beta'.*holds no config.json"):
        load("beta", str(tmp_path))
    with pytest.raises(ModelUnavailable, match="model 'beta'"):
        load("beta", "")


def test_the_cache_unloads_the_least_recently_used_model_and_saves_its_estimator(dirs, tmp_path):
    store = str(tmp_path / "estimator.json")
    loads: list[str] = []

    def loader(name: str, path: str):
        loads.append(name)
        return load(name, path, store)

    cat = ModelCatalog(load("alpha", str(dirs["alpha"])), loader, max_models=2)  # alpha + one other
    assert cat.get("alpha", "") is cat.default and loads == []
    beta = cat.get("beta", str(dirs["beta"]))
    assert cat.get("beta", str(dirs["beta"])) is beta and loads == ["beta"]  # cached
    beta.estimator.observe(features([7, 8, 9], beta.special_ids, 0), 5, None)  # something to save
    cat.get("gamma", str(dirs["gamma"]))  # beta out
    assert [c.name for c in cat.loaded()] == ["alpha", "gamma"]
    saved = list(tmp_path.glob("estimator.json.*"))  # one file per model (PATH.<model id>)
    assert len(saved) == 1 and json.loads(saved[0].read_text())
    assert cat.get("beta", str(dirs["beta"])) is not beta and loads == ["beta", "gamma", "beta"]
    cat.close()


def test_one_model_only_refuses_others(dirs):
    cat = ModelCatalog(load("alpha", str(dirs["alpha"])), lambda n, p: load(n, p), max_models=1)
    with pytest.raises(ModelUnavailable, match="--max-models 1"):
        cat.get("beta", str(dirs["beta"]))
    cat.close()
