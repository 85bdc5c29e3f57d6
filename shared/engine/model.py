"""Decoder-only transformer (Llama / Qwen2 / Mistral) over a paged KV cache.

Parameter names mirror the HF checkpoints (`model.layers.N.self_attn.q_proj.weight`, ...), so weights load
by name. Activations are token-major and unpadded: a batch is T tokens from several sequences, `[T, ...]`.

On a CUDA device with triton, `load_model` switches the model to its fused path (`CausalLM.fuse`): q/k/v and
gate/up weights concatenated into one GEMM each, RMSNorm fused with the residual add, RoPE fused with the KV
write, SwiGLU in one kernel (pdserve.engine.kernels). Same math and the same bf16 roundings as the module path,
which CPU keeps.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine import kernels
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.loader import ModelConfig, iter_weights


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the fused path's decode GEMVs, keys of CausalLM.small_m_gemv


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, gemv_cfg: dict | None,
           pdl: bool = False) -> torch.Tensor:
    """F.linear, or the Triton small-M GEMV (kernels/gemv.py) when `gemv_cfg` is set and x has few rows."""
    if gemv_cfg is not None and x.shape[0] <= 4:
        from pdserve.engine.kernels.gemv import gemv  # noqa: PLC0415 - imports triton

        return gemv(x, w, b, pdl=pdl, **gemv_cfg)
    return F.linear(x, w, b)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, identical to HF (default, linear and llama3 rope types)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)     # long wavelengths: divide
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled          # medium: interpolate
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise NotImplementedError(f"rope type {kind!r}")


class RotaryEmbedding:
    """Rotate-half RoPE; cos/sin computed per step from positions in float32 (as HF does)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, device: torch.device):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)  # [D/2]
        self.cos: torch.Tensor | None = None  # [max_positions, D/2] float32 (fused GPU path, see build_tables)
        self.sin: torch.Tensor | None = None

    def build_tables(self, max_positions: int) -> None:
        """cos/sin of positions * inv_freq (float32, as computed per step below) for the fused RoPE kernel."""
        freqs = torch.arange(max_positions, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        self.cos, self.sin = freqs.cos(), freqs.sin()

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D], k [T, KVH, D] -> rotated q, k."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]           # [T, 1, D]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        h, qd, kvd = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, qd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, kvd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, kvd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(qd, h, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, meta: AttentionMetadata,
                cache: KVCache, backend) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        o = backend.forward(self.layer_idx, q, k, v, meta, cache, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))

    def fuse(self) -> None:
        """Replace q/k/v_proj by one [(H + 2 KVH) * D, hidden] weight (frees the three originals)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = torch.cat([p.weight for p in projs])
        self.qkv_bias = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
        del self.q_proj, self.k_proj, self.v_proj

    def forward_fused(self, x: torch.Tensor, meta, rotary: RotaryEmbedding, cache: KVCache, backend,
                      gemv: dict | None = None, pdl: bool = False) -> torch.Tensor:
        from pdserve.engine.kernels.rope_kv_write import rope_kv_write  # noqa: PLC0415 - imports triton

        gemv = gemv or {}
        t = x.shape[0]
        qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias, gemv.get("qkv"), pdl)  # [T, qd + 2 kvd]
        q = qkv[:, :qd].view(t, self.num_heads, self.head_dim)
        k = qkv[:, qd:qd + kvd].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, qd + kvd:].view(t, self.num_kv_heads, self.head_dim)
        rope_kv_write(meta.positions, q, k, v, rotary.cos, rotary.sin, meta.slot_mapping,
                      cache.layer_pool(self.layer_idx), pdl=pdl)
        o = backend.attend(self.layer_idx, q, meta, cache, self.scale)  # [T, H, D]
        return linear(o.reshape(t, qd), self.o_proj.weight, self.o_proj.bias, gemv.get("o"), pdl)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse(self) -> None:
        """Replace gate/up_proj by one [2 * I, hidden] weight (frees the originals)."""
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_up_bias = torch.cat([self.gate_proj.bias, self.up_proj.bias]) if self.gate_proj.bias is not None \
            else None
        del self.gate_proj, self.up_proj

    def forward_fused(self, x: torch.Tensor, gemv: dict | None = None, pdl: bool = False) -> torch.Tensor:
        """With a Triton GEMV for `down` and few rows, SwiGLU runs inside the down GEMV (one kernel less)."""
        gemv = gemv or {}
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, gemv.get("gate_up"), pdl)  # [T, 2I]
        down = gemv.get("down")
        if down is not None and x.shape[0] <= 4:
            from pdserve.engine.kernels.gemv import gemv as gemv_kernel  # noqa: PLC0415 - imports triton

            return gemv_kernel(gate_up, self.down_proj.weight, self.down_proj.bias, act="silu_mul", pdl=pdl, **down)
        from pdserve.engine.kernels.silu_mul import silu_mul  # noqa: PLC0415 - imports triton

        return linear(silu_mul(gate_up, pdl=pdl), self.down_proj.weight, self.down_proj.bias, down, pdl)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, rotary, meta, cache, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, meta, cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None  # set by load_model on the real device
        self.fused = False                          # set by fuse() (CUDA + triton)
        # fused path, <= 4 rows: a Triton GEMV config per projection (PROJECTIONS; None or absent: cuBLAS)
        self.small_m_gemv: dict[str, dict | None] = {}
        self.pdl = False  # fused path: launch the Triton kernels with programmatic dependent launch (Hopper)

    def fuse(self) -> None:
        """Switch to the fused GPU path (see the module docstring). Needs kernels.enabled and `fusable`."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.rotary.build_tables(self.config.max_position_embeddings)
        from pdserve.engine.kernels.gemv import DEFAULT_PLAN  # noqa: PLC0415 - imports triton

        self.small_m_gemv = {name: DEFAULT_PLAN[name] and dict(DEFAULT_PLAN[name]) for name in PROJECTIONS}
        self.pdl = kernels.pdl_supported(self.lm_head.weight.device)
        self.fused = True

    @staticmethod
    def fusable(cfg: ModelConfig) -> bool:
        """The fused kernels need power-of-two head_dim and KV head count (tl.arange)."""
        return kernels.is_pow2(cfg.head_dim) and cfg.head_dim >= 16 and kernels.is_pow2(cfg.num_kv_heads)

    def _forward_fused(self, input_ids: torch.Tensor, meta, cache: KVCache, backend) -> torch.Tensor:
        """Residual stream kept in `residual` (updated in place by the fused add+RMSNorm kernel)."""
        from pdserve.engine.kernels.rmsnorm import rmsnorm  # noqa: PLC0415 - imports triton

        layers = self.model.layers
        gemv, pdl = self.small_m_gemv, self.pdl
        residual = self.model.embed_tokens(input_ids)                       # [T, hidden]
        h = rmsnorm(residual, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps, pdl=pdl)
        for i, layer in enumerate(layers):
            a = layer.self_attn.forward_fused(h, meta, self.rotary, cache, backend, gemv, pdl)
            norm = layer.post_attention_layernorm
            h = rmsnorm(a, norm.weight, norm.eps, residual, pdl=pdl)       # residual += a; h = norm(residual)
            m = layer.mlp.forward_fused(h, gemv, pdl)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h = rmsnorm(m, norm.weight, norm.eps, residual, pdl=pdl)
        return h

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: KVCache, backend) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden] (after the last norm)."""
        if self.fused:
            return self._forward_fused(input_ids, meta, cache, backend)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, meta.positions, self.rotary, meta, cache, backend)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()


def load_model(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Build the model on the meta device and assign the checkpoint's tensors by name (strict)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = {name: t for name, t in iter_weights(model_dir, device, dtype) if not name.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings:
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {cfg.arch}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
    model = model.eval().requires_grad_(False)
    if device.type == "cuda" and kernels.enabled(torch.empty(0, device=device)) and CausalLM.fusable(cfg):
        model.fuse()
    return model
