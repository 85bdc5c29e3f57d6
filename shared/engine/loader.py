"""Read a local Hugging Face model directory: config, safetensors weights, tokenizer, fingerprint."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine.quant.fp8_checkpoint import Fp8Scheme, is_scale_name, parse_quantization_config

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass
class ModelConfig:
    arch: str  # llama | qwen2 | qwen3 | mistral
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # normalized: has "rope_type"; None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v/o (Llama flag)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    qkv_bias: bool = False  # bias on q/k/v only (Qwen2), or all with attention_bias
    mlp_bias: bool = False
    torch_dtype: str | None = None  # checkpoint dtype name, e.g. "bfloat16"
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    quantization: Fp8Scheme | None = None  # the checkpoint's FP8 format (config.json quantization_config)


def _as_list(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else [int(v)]


def _rope_params(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers>=5 `rope_parameters` or the older rope_theta/rope_scaling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **scaling}


def parse_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse config.json (+ generation_config.json for EOS ids); raise for what the engine cannot run."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: model_dir must be a local Hugging Face model directory")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r} is not supported (only silu)")
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    window = cfg.get("sliding_window")
    uses_window = arch == "mistral" or (arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window", False))
    if uses_window and window is not None and int(window) < max_pos:
        raise NotImplementedError(
            f"sliding_window={window} < max_position_embeddings={max_pos}: sliding-window "
            "attention is not implemented by this engine"
        )
    theta, scaling = _rope_params(cfg)
    num_heads = int(cfg["num_attention_heads"])
    eos = _as_list(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        for t in _as_list(json.loads(gen_path.read_text()).get("eos_token_id")):
            if t not in eos:
                eos.append(t)
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        qkv_bias=(arch == "qwen2") or attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        qk_norm=arch == "qwen3",
        quantization=parse_quantization_config(cfg.get("quantization_config")),
    )


def safetensors_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_weights(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor on `device`) for every tensor of every shard: floating-point tensors in `dtype`,
    except FP8 weights (kept e4m3) and their scales (float32)."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                t = raw = f.get_tensor(name)
                if is_scale_name(name):
                    t = t.float()
                elif t.is_floating_point() and t.dtype != torch.float8_e4m3fn:
                    t = t.to(dtype)
                if t.device.type == "cpu" and t is raw:  # still a view of the file's memory map: copy it out, so
                    t = t.clone()  # the map (and every file page loading touched) is gone once the file is closed
                yield name, t


LOAD_FORMATS = ("auto", "dummy")  # EngineConfig.load_format: the checkpoint's safetensors | random weights
DUMMY_SEED = 0  # the dummy weights' generator seed (fixed: every instance of one config holds the same weights)


def iter_dummy_weights(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = DUMMY_SEED
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield what `iter_weights` yields for a checkpoint of `cfg`'s shape, random and made on `device` (load_format
    "dummy": no file read): projection weights ~ N(0, 1/K), in e4m3 with the scales of `cfg.quantization`'s
    layout when the config says FP8 (quant/fp8_convert.random_tensors), else in `dtype`; embeddings and lm_head in
    `dtype`; norms near 1, biases small. One generator seeded `seed`: the same config gives the same weights."""
    from pdserve.engine.quant.fp8_convert import random_tensors, scheme_format

    g = torch.Generator(device=device).manual_seed(seed)
    fmt = scheme_format(cfg.quantization) if cfg.quantization is not None else None
    h, hd, ffn = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def mat(rows: int, cols: int, std: float) -> torch.Tensor:  # [rows, cols] in dtype
        return torch.randn(rows, cols, device=device, generator=g).mul_(std).to(dtype)

    def vec(n: int, mean: float, std: float) -> torch.Tensor:  # [n] in dtype
        return torch.randn(n, device=device, generator=g).mul_(std).add_(mean).to(dtype)

    yield "model.embed_tokens.weight", mat(cfg.vocab_size, h, 0.25)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        projections = {"self_attn.q_proj": (qd, h, cfg.qkv_bias), "self_attn.k_proj": (kvd, h, cfg.qkv_bias),
                       "self_attn.v_proj": (kvd, h, cfg.qkv_bias), "self_attn.o_proj": (h, qd, cfg.attention_bias),
                       "mlp.gate_proj": (ffn, h, cfg.mlp_bias), "mlp.up_proj": (ffn, h, cfg.mlp_bias),
                       "mlp.down_proj": (h, ffn, cfg.mlp_bias)}  # fmt: skip
        for proj, (n, k, bias) in projections.items():
            name = f"{p}{proj}.weight"
            if fmt is None:
                yield name, mat(n, k, k**-0.5)
            else:
                yield from random_tensors(name, n, k, k**-0.5, fmt, g).items()
            if bias:
                yield f"{p}{proj}.bias", vec(n, 0.0, 0.02)
        if cfg.qk_norm:
            yield f"{p}self_attn.q_norm.weight", vec(hd, 1.0, 0.1)
            yield f"{p}self_attn.k_norm.weight", vec(hd, 1.0, 0.1)
        yield f"{p}input_layernorm.weight", vec(h, 1.0, 0.1)
        yield f"{p}post_attention_layernorm.weight", vec(h, 1.0, 0.1)
    yield "model.norm.weight", vec(h, 1.0, 0.1)
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", mat(cfg.vocab_size, h, h**-0.5)


def model_fingerprint(model_dir: str | Path, quantization: str = "none", load_format: str = "auto") -> str:
    """sha256 over config.json and, per safetensors shard (sorted), its name, size, JSON header and 16 samples
    of 4 KiB at evenly spaced offsets. Cheap on huge checkpoints; catches different weights in practice.
    `quantization` other than "none" (online FP8: other weights, other KV) is hashed in too. `load_format`
    "dummy": config.json, the quantization and the dummy weights' seed (no shard is read; there may be none)."""
    h = hashlib.sha256()
    h.update((Path(model_dir) / "config.json").read_bytes())
    if quantization != "none":
        h.update(b"quantization=" + quantization.encode())
    if load_format == "dummy":
        h.update(f"load_format=dummy seed={DUMMY_SEED}".encode())
        return h.hexdigest()[:32]
    sample = 4096
    for path in safetensors_files(model_dir):
        size = path.stat().st_size
        h.update(path.name.encode() + b"\0" + str(size).encode())
        with open(path, "rb") as f:
            head = f.read(8)
            (header_len,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            h.update(head + f.read(min(header_len, max(size - 8, 0))))
            for i in range(16):
                f.seek(i * max(size - sample, 0) // 15)
                h.update(f.read(sample))
    return h.hexdigest()[:32]


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
