"""The router's tokenizer (`pdserve.router.tokenizer`) tokenizes as the one `AutoTokenizer` loads (ids, text, chat
template, special tokens), also for a config that names no class, and loading it leaves torch unloaded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from pdserve.models.checkpoints import build_checkpoint
from pdserve.router.tokenizer import load_tokenizer, tokenizer_class_name

TEXTS = ["Hello, world! Ünïcode and   spaces.\n", " leading space", "a<|im_end|>b", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tok") / request.param, arch=request.param, seed=1)


def assert_same(ours, ref) -> None:
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids
        assert ours.decode(ids) == ref.decode(ids)
    template = {"add_generation_prompt": True, "tokenize": False}
    assert ours.apply_chat_template(CHAT, **template) == ref.apply_chat_template(CHAT, **template)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (
        ref.eos_token_id,
        ref.bos_token_id,
        ref.all_special_ids,
    )


def test_same_tokenizer_as_auto(model_dir):
    assert tokenizer_class_name(model_dir) is not None
    assert_same(load_tokenizer(model_dir), AutoTokenizer.from_pretrained(str(model_dir)))


def test_a_config_without_a_class_falls_back_to_auto(model_dir, tmp_path):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class")
    for f in model_dir.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_class_name(tmp_path) is None
    assert_same(load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(model_dir)))


def test_loading_does_not_import_torch(model_dir):
    code = f"import sys\nfrom pdserve.router.tokenizer import load_tokenizer\nload_tokenizer({str(model_dir)!r})\n"
    code += "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
