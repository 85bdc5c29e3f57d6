"""Read a local Hugging Face model directory: config, safetensors weights, tokenizer, fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


# safetensors dtype names (its format's spec) -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def read_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for each tensor of one safetensors file, in file order, each read into a tensor of
    its own with plain reads. No memory map: safetensors' `safe_open` maps the file, and every page a load touched
    counts in the process's RSS until the file is closed, the whole checkpoint beside its copy at the load's peak.
    A header that does not describe the file raises ValueError."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        (header_len,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        if header_len > size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {header_len}, file size {size})")
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            start, end = info["data_offsets"]
            t = torch.empty(info["shape"], dtype=dtype) if dtype is not None else None
            if t is None or end - start != t.numel() * t.element_size() or base + end > size:
                raise ValueError(f"{path}: tensor {name!r} ({info['dtype']}, {info['shape']}) does not fit its bytes")
            buf = t.reshape(-1).view(torch.uint8).numpy().data  # [bytes] the tensor's own memory
            f.seek(base + start)
            done = 0
            while done < len(buf):
                n = f.readinto(buf[done:])
                if not n:
                    raise ValueError(f"{path}: ends inside tensor {name!r}")
                done += n
            yield name, t


def iter_weights(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor on `device`) for every tensor of every shard: floating-point tensors in `dtype`,
    except FP8 weights (kept e4m3) and their scales (float32). On CPU through `read_safetensors` (one tensor in
    memory beside the model at a time, no file pages mapped), elsewhere through safetensors' `safe_open`."""
    for path in safetensors_files(model_dir):
        if device.type == "cpu":
            tensors = read_safetensors(path)
        else:
            tensors = _safe_open_tensors(path, device)
        for name, t in tensors:
            if is_scale_name(name):
                t = t.float()
            elif t.is_floating_point() and t.dtype != torch.float8_e4m3fn:
                t = t.to(dtype)
            yield name, t


def _safe_open_tensors(path: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


LOAD_FORMATS = ("auto", "dummy")  # EngineConfig.load_format: the checkpoint's safetensors | random weights
DUMMY_SEED = 0  # the dummy weights' generator seed (fixed: every instance of one config holds the same weights)
DUMMY_SCRATCH_ELEMENTS = 1 << 24  # float32 values drawn at a time (64 MiB), whatever the tensor's size


class RandomFill:
    """Fills tensors with random normal values drawn rows at a time into one float32 scratch that lives as long as
    this object: no float32 copy of a whole weight (a 70B gate_proj is 0.9 GB in float32), and no freed temporary
    for the next weight to be placed in (the caching allocator splits a free block for a smaller request, and the
    rest of that block stays reserved, unusable by the next large temporary: holes that add up over 80 layers)."""

    def __init__(self, g: torch.Generator, device: torch.device):
        self.g, self.device = g, device
        self.scratch = torch.empty(0, device=device)  # grown to what the largest row block needs, <= the cap

    def __call__(self, out: torch.Tensor, std: float, mean: float = 0.0, clip: float | None = None) -> torch.Tensor:
        """out [N, K] (any float dtype, e4m3 included) <- N(mean, std^2), each value clipped to ±`clip` before the
        cast; returns `out`."""
        n, k = out.shape
        step = max(1, DUMMY_SCRATCH_ELEMENTS // max(k, 1))
        if self.scratch.numel() < min(n, step) * k:
            self.scratch = torch.empty(min(n, step) * k, device=self.device)
        for r in range(0, n, step):
            rows = min(step, n - r)
            x = self.scratch[: rows * k].view(rows, k).normal_(mean, std, generator=self.g)
            out[r : r + rows].copy_(x if clip is None else x.clamp_(-clip, clip))
        return out


def iter_dummy_weights(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = DUMMY_SEED
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield what `iter_weights` yields for a checkpoint of `cfg`'s shape, random and made on `device` (load_format
    "dummy": no file read): projection weights ~ N(0, 1/K), in e4m3 with the scales of `cfg.quantization`'s
    layout when the config says FP8 (quant/fp8_convert.random_tensors: the codes drawn straight into the e4m3
    tensor), else in `dtype`; embeddings and lm_head in `dtype`; norms near 1, biases small. Tensor by tensor,
    through `RandomFill`'s one scratch. One generator seeded `seed`: the same config gives the same weights."""
    from pdserve.engine.quant.fp8_convert import RANDOM_Q_STD, random_tensors, scheme_format
    from pdserve.engine.quant.fp8_quant import FP8, FP8_MAX

    g = torch.Generator(device=device).manual_seed(seed)
    fill = RandomFill(g, device)
    fmt = scheme_format(cfg.quantization) if cfg.quantization is not None else None
    h, hd, ffn = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd, kvd = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def mat(rows: int, cols: int, std: float) -> torch.Tensor:  # [rows, cols] in dtype
        return fill(torch.empty(rows, cols, dtype=dtype, device=device), std)

    def vec(n: int, mean: float, std: float) -> torch.Tensor:  # [n] in dtype
        return fill(torch.empty(1, n, dtype=dtype, device=device), std, mean)[0]

    def codes(rows: int, cols: int) -> torch.Tensor:  # [rows, cols] e4m3 codes ~ N(0, 64^2), clipped to ±448
        return fill(torch.empty(rows, cols, dtype=FP8, device=device), RANDOM_Q_STD, clip=FP8_MAX)

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
                yield from random_tensors(name, n, k, k**-0.5, fmt, g, codes=codes(n, k)).items()
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


# tokenizer_config.json's named special tokens: transformers marks each special in its backend (skipped by decode's
# skip_special_tokens) beside the lists below
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
SPECIAL_TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")
AS_SAVED_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers loads tokenizer.json as it is


def _token_contents(value: Any) -> list[str]:
    """Token strings from a tokenizer_config.json value: "tok", {"content": "tok", ...}, or a list / dict of those."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return [value["content"]]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [c for v in items for c in _token_contents(v)]


def _added_token(cls: Any, entry: dict) -> Any:
    """A `tokenizers.AddedToken` from one tokenizer_config.json added_tokens_decoder entry."""
    special = bool(entry.get("special", False))
    flags = {k: bool(entry[k]) for k in ("single_word", "lstrip", "rstrip") if k in entry}
    return cls(entry["content"], special=special, normalized=bool(entry.get("normalized", not special)), **flags)


class FileTokenizer:
    """An engine's tokenizer without transformers: the model's tokenizer.json through the `tokenizers` library.
    In an engine process (torch loaded) transformers' tokenizer brings torch.distributed, sympy and accelerate with
    it: ~100 MB of RSS per engine and seconds of start, to decode ids. Same backend as transformers builds for the
    classes that load tokenizer.json as it is (AS_SAVED_CLASSES), with the tokens tokenizer_config.json adds to it
    added as transformers adds them, so decoding gives the same text (tests/shared/engine/
    test_engine_loader_tokenizer.py). `hf()`: transformers' tokenizer, loaded on first use (xgrammar's structured
    output reads one)."""

    def __init__(self, model_dir: str | Path, backend: Any):
        self.model_dir = Path(model_dir)
        self._tokenizer = backend  # transformers' name for its backend: IncrementalDetokenizer calls it directly
        self._hf: Any = None

    @classmethod
    def load(cls, model_dir: str | Path) -> FileTokenizer | None:
        """None where transformers would build another backend: no tokenizer.json, or a tokenizer class of its own
        (model-specific classes rebuild the backend from the vocabulary, with their own decoder)."""
        model_dir = Path(model_dir)
        path, config_path = model_dir / "tokenizer.json", model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        if not path.exists() or config.get("tokenizer_class") not in AS_SAVED_CLASSES:
            return None
        from tokenizers import AddedToken, Tokenizer

        backend = Tokenizer.from_file(str(path))
        # transformers adds what the config lists that tokenizer.json lacks, in this order: its added_tokens_decoder
        # (with their flags), then the named special tokens as special; an added token keeps its own flags
        listed = sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0]))
        tokens = [_added_token(AddedToken, v) for _, v in listed if isinstance(v, dict) and "content" in v]
        named = [c for k in (*SPECIAL_TOKEN_KEYS, *SPECIAL_TOKEN_LISTS) for c in _token_contents(config.get(k))]
        tokens += [AddedToken(c, special=True, normalized=False) for c in named]
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        for t in tokens:
            if t.content not in present:
                present.add(t.content)
                backend.add_tokens([t])
        return cls(model_dir, backend)

    def decode(
        self, ids: int | list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> str:
        """`ids` as text; spaces never cleaned up (the engine never asks; transformers skips it for BPE as well)."""
        return self._tokenizer.decode(
            [ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """tokenizer.json's encoding of `text` (requests reach the engine tokenized: the router's tokenizer)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def get_added_vocab(self) -> dict[str, int]:
        """{token: id} of the added tokens (special ones included), as transformers' `get_added_vocab`."""
        return {t.content: i for i, t in sorted(self._tokenizer.get_added_tokens_decoder().items())}

    def hf(self) -> Any:
        """transformers' tokenizer of the same directory (loaded on the first call)."""
        if self._hf is None:
            self._hf = load_hf_tokenizer(self.model_dir)
        return self._hf


def load_hf_tokenizer(model_dir: str | Path) -> Any:
    """transformers' tokenizer, through the class tokenizer_config.json names as the router loads it: AutoTokenizer
    reads the model config first, whose model code imports torch.distributed and sympy (~60 MB, ~2.5 s)."""
    from pdserve.router.tokenizer import load_tokenizer as load_router_tokenizer

    return load_router_tokenizer(model_dir)


def load_tokenizer(model_dir: str | Path) -> Any:
    """The engine's tokenizer (text deltas, think tags, structured output): a `FileTokenizer` where transformers
    would load tokenizer.json as it is, else transformers' own."""
    return FileTokenizer.load(model_dir) or load_hf_tokenizer(model_dir)
