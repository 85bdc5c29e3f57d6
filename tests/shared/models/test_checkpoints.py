"""The test checkpoint builder writes real HF checkpoints that load through transformers."""

from transformers import AutoTokenizer

from pdserve.models.checkpoints import build_checkpoint, read_config


def test_checkpoint_loads_with_and_without_chat_template(tmp_path):
    path = build_checkpoint(tmp_path / "a", arch="llama", seed=0)
    cfg = read_config(path)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 512
    tok = AutoTokenizer.from_pretrained(str(path))
    assert max(tok("hello world").input_ids) < cfg["vocab_size"] and len(tok) == cfg["vocab_size"]
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = build_checkpoint(tmp_path / "b", arch="qwen2", seed=0, chat_template=None)
    assert not AutoTokenizer.from_pretrained(str(plain)).chat_template
