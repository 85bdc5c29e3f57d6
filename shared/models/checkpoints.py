"""Build real Hugging Face checkpoints locally (no model hub): random-init weights + a BPE tokenizer.

Used by the tests (and `train_tiny`), which then load them through the same path a user's local model directory
takes. The demo model `pdserve up` serves is in `pdserve.models.demo`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CORPUS_PATH = Path(__file__).parent.parent / "data" / "corpus.txt"  # the pdserve.data package
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2/SmolLM2 write it
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelShape(TypedDict, total=False):
    """Hugging Face config sizes a checkpoint is built with (any subset overrides the tiny defaults)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


# Small shapes: fast on CPU, yet every structural feature (GQA, bias, tied embeddings) is present.
TINY_SHAPES = ModelShape(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def corpus_text() -> str:
    """The training/evaluation text shipped in the package (Python docs excerpt, PSF license)."""
    lines = CORPUS_PATH.read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("# "))


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, chat_template: str | None = CHATML_TEMPLATE) -> None:
    """Train a byte-level BPE tokenizer on the shipped corpus and save it as HF tokenizer files
    (with `chat_template`, a Jinja template; None: a tokenizer without one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus_text()], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))


def build_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    vocab_size: int = 512,
    chat_template: str | None = CHATML_TEMPLATE,
    **overrides: Any,
) -> Path:
    """Write config.json + model.safetensors + tokenizer files for `arch` in {llama, qwen2, qwen3, mistral}
    (`chat_template`: the tokenizer's, ChatML by default; None for a model without one).

    Weights are random (seeded): the model's output is noise, but it is a real checkpoint.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=vocab_size, chat_template=chat_template)
    shapes = {**TINY_SHAPES, **overrides}
    common: dict[str, Any] = dict(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=None, **shapes)
    torch.manual_seed(seed)  # the random init below
    # rope_theta: a parameter in transformers 4.x, folded into rope_parameters by 5.x (whose stubs lack it)
    model: PreTrainedModel
    if arch == "llama":
        llama = LlamaConfig(rope_theta=10000.0, tie_word_embeddings=False, **common)  # type: ignore[call-arg]
        model = LlamaForCausalLM(llama)
    elif arch == "qwen2":
        qwen2 = Qwen2Config(rope_theta=1000000.0, tie_word_embeddings=True, **common)  # type: ignore[call-arg]
        model = Qwen2ForCausalLM(qwen2)
    elif arch == "qwen3":  # per-head q/k RMSNorm, explicit head_dim (defaults to hidden / heads here)
        common.setdefault("head_dim", shapes["hidden_size"] // shapes["num_attention_heads"])
        qwen3 = Qwen3Config(rope_theta=1000000.0, tie_word_embeddings=True, **common)  # type: ignore[call-arg]
        model = Qwen3ForCausalLM(qwen3)
    elif arch == "mistral":
        mistral = MistralConfig(  # type: ignore[call-arg]
            rope_theta=10000.0, tie_word_embeddings=False, sliding_window=None, **common
        )
        model = MistralForCausalLM(mistral)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    model = model.to(dtype)  # type: ignore[arg-type]  # transformers types .to through a decorator stub
    with torch.no_grad():  # HF's default init (std 0.02) gives near-uniform logits; widen it so argmax is stable
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" in name else 1.0 / p.shape[-1] ** 0.5)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def read_config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())
