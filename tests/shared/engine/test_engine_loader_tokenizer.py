"""The engine's tokenizer (`loader.load_tokenizer`): tokenizer.json through the `tokenizers` library decodes as the
tokenizer transformers loads (every id, random sequences, special tokens skipped or kept, the added vocabulary),
also where tokenizer_config.json adds tokens to tokenizer.json; model-specific tokenizer classes keep transformers'.
And an engine process holds neither transformers nor torch._dynamo (~250 MB of RSS between them)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from pdserve.engine.loader import FileTokenizer, load_tokenizer

TEXTS = ["Hello, world! Ünïcode and   spaces.\n", " leading space", "a<|im_end|>b", "<s>x</s>", ""]


def assert_decodes_alike(ours, ref) -> None:
    n = len(ref)
    for i in range(n):
        for skip in (False, True):
            assert ours.decode([i], skip_special_tokens=skip) == ref.decode([i], skip_special_tokens=skip), i
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 24))]
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), ids
    assert ours.get_added_vocab() == ref.get_added_vocab()
    assert [ours.encode(t) for t in TEXTS] == [ref.encode(t) for t in TEXTS]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_decodes_as_transformers(checkpoint, name):
    d = checkpoint(name)
    ours = load_tokenizer(d)
    assert isinstance(ours, FileTokenizer)
    assert_decodes_alike(ours, AutoTokenizer.from_pretrained(str(d)))


def _not_special_in_json(tok: dict, config: dict) -> None:
    for t in tok["added_tokens"]:
        t["special"] = t["content"] != "<|im_end|>"  # the config's extra_special_tokens still name it


def _tokens_only_in_config(tok: dict, config: dict) -> None:
    config["pad_token"] = "<pad>"
    config["added_tokens_decoder"] = {"513": {"content": "<sp>", "special": True},
                                      "512": {"content": "<plain>", "special": False, "normalized": True}}  # fmt: skip


@pytest.mark.parametrize("edit", [_not_special_in_json, _tokens_only_in_config])
def test_what_the_config_adds_is_added_as_transformers_does(checkpoint, tmp_path, edit):
    d = tmp_path / "m"
    shutil.copytree(checkpoint("llama"), d)
    tok, config = (json.loads((d / f).read_text()) for f in ("tokenizer.json", "tokenizer_config.json"))
    edit(tok, config)
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    ref = AutoTokenizer.from_pretrained(str(d))
    assert_decodes_alike(load_tokenizer(d), ref)


def test_a_model_specific_class_keeps_transformers_tokenizer(checkpoint, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(checkpoint("qwen2"), d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    tok = load_tokenizer(d)
    assert not isinstance(tok, FileTokenizer) and type(tok).__name__ == "Qwen2Tokenizer"
    assert type(FileTokenizer.load(checkpoint("qwen2")).hf()).__name__ == "TokenizersBackend"  # its lazy one


def test_an_engine_imports_neither_transformers_nor_dynamo(checkpoint):
    code = (
        "import sys\nfrom pdserve.engine.config import EngineConfig\nfrom pdserve.engine.engine import LLMEngine\n"
        "from pdserve.engine.sampling import SamplingParams\n"
        f"e = LLMEngine(EngineConfig(model_dir={str(checkpoint('llama'))!r}, device='cpu', dtype='float32', "
        "num_pages=16, page_size=4, chunk_size=8))\n"
        "e.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))\n"
        "print(sorted(m for m in ('transformers', 'torch._dynamo', 'sympy', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
