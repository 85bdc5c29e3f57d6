"""A random-weight checkpoint of a real model's shape (default Llama-3-8B), written shard by shard in the HF layout,
for GPU benchmarks: the engine loads it through the same path as a user's model directory."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B_SHAPE = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)


def write_random_llama(
    out: Path,
    layers: int = 32,
    seed: int = 0,
    device: torch.device | str = "cuda",
    shape: dict[str, int] | None = None,
    max_position_embeddings: int = 16384,
) -> int:
    """Random bf16 Llama checkpoint of `shape` (HF layout, 8 layers per shard, generated on `device`).
    Returns the parameter count."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from pdserve.models.checkpoints import build_tokenizer

    shape = dict(LLAMA3_8B_SHAPE if shape is None else shape)
    out.mkdir(parents=True, exist_ok=True)
    sizes: dict[str, Any] = shape  # HF config kwargs are of mixed types
    # rope_theta: a parameter in transformers 4.x, folded into rope_parameters by 5.x (whose stubs lack it)
    cfg = LlamaConfig(  # type: ignore[call-arg]
        num_hidden_layers=layers,
        max_position_embeddings=max_position_embeddings,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **sizes,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(str(out))
    build_tokenizer(out)
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    h, ffn, hd, vocab = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"], shape["vocab_size"]
    qd, kvd = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd

    def mat(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, device=dev, generator=g) * std).to(torch.bfloat16).cpu()

    def norm() -> torch.Tensor:
        return (1 + 0.1 * torch.randn(h, device=dev, generator=g)).to(torch.bfloat16).cpu()

    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    n_params, shard_id = 0, 0
    total_shards = math.ceil(layers / 8) + 1

    def flush() -> None:
        nonlocal shard, shard_id
        shard_id += 1
        name = f"model-{shard_id:05d}-of-{total_shards:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        for k in shard:
            weight_map[k] = name
        shard = {}

    shard["model.embed_tokens.weight"] = mat(vocab, h, 0.25)
    for i in range(layers):
        p = f"model.layers.{i}."
        shard[p + "self_attn.q_proj.weight"] = mat(qd, h, h**-0.5)
        shard[p + "self_attn.k_proj.weight"] = mat(kvd, h, h**-0.5)
        shard[p + "self_attn.v_proj.weight"] = mat(kvd, h, h**-0.5)
        shard[p + "self_attn.o_proj.weight"] = mat(h, qd, qd**-0.5)
        shard[p + "mlp.gate_proj.weight"] = mat(ffn, h, h**-0.5)
        shard[p + "mlp.up_proj.weight"] = mat(ffn, h, h**-0.5)
        shard[p + "mlp.down_proj.weight"] = mat(h, ffn, ffn**-0.5)
        shard[p + "input_layernorm.weight"] = norm()
        shard[p + "post_attention_layernorm.weight"] = norm()
        n_params += sum(t.numel() for k, t in shard.items() if k.startswith(p))
        if (i + 1) % 8 == 0:
            n_params += sum(t.numel() for k, t in shard.items() if not k.startswith("model.layers."))
            flush()
    shard["model.norm.weight"] = norm()
    shard["lm_head.weight"] = mat(vocab, h, h**-0.5)
    n_params += sum(t.numel() for k, t in shard.items() if not k.startswith("model.layers."))
    flush()
    index = {"metadata": {"total_size": 2 * n_params}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return n_params
