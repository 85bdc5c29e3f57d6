"""Decoder-only transformer (Llama / Qwen2 / Qwen3 / Mistral) over a paged KV cache.

Weights load from HF checkpoints by name, with q/k/v and gate/up concatenated at load into one projection each
(`self_attn.qkv_proj`, `mlp.gate_up_proj`): one GEMM each on every device. Activations are token-major and
unpadded: a batch is T tokens from several sequences, `[T, ...]`.

One module tree, one forward path: each op goes through the `KernelChoice` the model holds (set once at load,
`CausalLM.use_kernels`), which runs plain torch ops on CPU and the fused Triton kernels on CUDA (RMSNorm fused
with the residual add, RoPE fused with the KV write, SwiGLU in one kernel, small-row GEMVs).

FP8 weights (a checkpoint's `quantization_config`, or `quantization="fp8"` on a bf16 checkpoint): on CUDA the
projections become `Fp8Linear` layers (e4m3 weights on the tensor cores, quant/fp8_linear.py); on CPU the FP8
weights are dequantized once at load into the compute dtype, so the CPU model is an ordinary one over the exact
dequantized values (the reference the tests compare with transformers).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.kernel_choice import KernelChoice
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.loader import ModelConfig, iter_dummy_weights, iter_weights
from pdserve.engine.quant.fp8_checkpoint import ONLINE_FP8, Fp8Scheme, normalize_state
from pdserve.engine.quant.fp8_linear import Fp8Activation, Fp8Linear
from pdserve.engine.quant.fp8_quant import FP8, dequantize_weight, quantize_weight_per_channel

if TYPE_CHECKING:
    from pdserve.engine.tp.comm import TPGroup
    from pdserve.engine.tp.layers import RankShard

QUANTIZATIONS = ("none", "fp8")  # EngineConfig.quantization: online quantization of an unquantized checkpoint


def project(kc: KernelChoice, layer: nn.Module, x: torch.Tensor | Fp8Activation, proj: str) -> torch.Tensor:
    """x [T, in] -> layer(x) [T, out]: an `Fp8Linear` runs itself (x may come quantized: `norm_for`); an nn.Linear
    goes through the kernel choice."""
    if isinstance(layer, Fp8Linear):
        return layer(x, pdl=kc.pdl)
    assert isinstance(x, torch.Tensor)  # norm_for quantizes only for an Fp8Linear
    linear = cast(nn.Linear, layer)
    return kc.linear(x, linear.weight, linear.bias, proj)


def norm_for(
    kc: KernelChoice, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, consumer: nn.Module | None
) -> torch.Tensor | Fp8Activation:
    """norm(x), or (with `residual`) residual += x then norm(residual), for the projection `consumer` that reads it
    next: an `Fp8Linear` that quantizes its input per token (`takes_fp8`) gets it quantized by the norm kernel, the
    rest the activation-dtype output."""
    if kc.fused and isinstance(consumer, Fp8Linear) and consumer.takes_fp8(x.shape[0]):
        from pdserve.engine.kernels.rmsnorm import rmsnorm_fp8

        q, scale = rmsnorm_fp8(x, norm.weight, norm.eps, residual, pdl=kc.pdl)
        return Fp8Activation(q, scale, x.dtype)
    return kc.rmsnorm(x, norm) if residual is None else kc.add_rmsnorm(x, residual, norm)


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
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)  # long wavelengths: divide
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # medium: interpolate
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise NotImplementedError(f"rope type {kind!r}")


class RotaryEmbedding:
    """Rotate-half RoPE; cos/sin computed per step from positions in float32 (as HF does)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, device: torch.device):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)  # [D/2]
        self.cos: torch.Tensor | None = None  # [max_positions, D/2] float32 (fused RoPE kernel, build_tables)
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
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h, qd, kvd = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(h, qd + 2 * kvd, bias=cfg.qkv_bias)  # rows: q | k | v
        self.o_proj = nn.Linear(qd, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None  # Qwen3: per head
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.kernels = KernelChoice()
        self.tp: TPGroup | None = None  # tensor parallel: o_proj's partial sums are all-reduced over this group

    def forward(
        self, x: torch.Tensor | Fp8Activation, meta: AttentionMetadata, rotary: RotaryEmbedding, cache: KVCache, backend
    ) -> torch.Tensor:
        """x [T, hidden] (FP8 qkv_proj: maybe quantized, `norm_for`) -> [T, hidden]; this step's K/V are stored in
        `cache` on the way."""
        q = self.query_and_store(x, meta, rotary, cache)
        o = backend.attend(self.layer_idx, q, meta, cache, self.scale)  # [T, H, D]
        return self.project_out(o.reshape(q.shape[0], -1))

    def query_and_store(self, x: torch.Tensor | Fp8Activation, meta, rotary: RotaryEmbedding, cache: KVCache):
        """The part before attention: x [T, hidden] -> rotated q [T, H, D]; k/v rotated and stored at
        `meta.slot_mapping` (only `positions` and `slot_mapping` of `meta` are read)."""
        kc = self.kernels
        qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = project(kc, self.qkv_proj, x, "qkv")  # [T, qd + 2 kvd]
        t = qkv.shape[0]
        q = qkv[:, :qd].view(t, self.num_heads, self.head_dim)
        k = qkv[:, qd : qd + kvd].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, qd + kvd :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # RMSNorm over each head's D (rows [T * H, D])
            q = kc.rmsnorm(q.reshape(-1, self.head_dim), self.q_norm).view(t, self.num_heads, self.head_dim)
            k = kc.rmsnorm(k.reshape(-1, self.head_dim), self.k_norm).view(t, self.num_kv_heads, self.head_dim)
        return kc.rope_and_store(self.layer_idx, q, k, v, meta, rotary, cache)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """The part after attention: o [T, H * D] -> [T, hidden] (all-reduced at tensor parallel)."""
        out = project(self.kernels, self.o_proj, o, "o")
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=b)  # rows: gate | up
        self.down_proj = nn.Linear(i, h, bias=b)
        self.kernels = KernelChoice()
        self.tp: TPGroup | None = None  # tensor parallel: down_proj's partial sums are all-reduced over this group

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """x [T, hidden] (FP8 gate_up_proj: maybe quantized, `norm_for`) -> down(silu(gate(x)) * up(x))
        [T, hidden]."""
        out = self._swiglu_down(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _swiglu_down(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        kc = self.kernels
        gate_up = project(kc, self.gate_up_proj, x, "gate_up")  # [T, 2I]
        if isinstance(self.down_proj, Fp8Linear):
            if kc.fused:
                from pdserve.engine.kernels.silu_mul import silu_mul, silu_mul_fp8, single_pass_fits

                down = self.down_proj
                if down.takes_fp8(gate_up.shape[0]) and single_pass_fits(down.in_features):
                    # SwiGLU writes e4m3 + row scales (in one pass only: its row loop is slower than the separate
                    # quantizer pass)
                    q, scale = silu_mul_fp8(gate_up, pdl=kc.pdl)
                    return down(Fp8Activation(q, scale, gate_up.dtype), pdl=kc.pdl)
                return down(silu_mul(gate_up, pdl=kc.pdl), pdl=kc.pdl)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(torch.nn.functional.silu(gate) * up)
        return kc.swiglu_linear(gate_up, self.down_proj.weight, self.down_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # `_weight`: no random init (load_model assigns the checkpoint's). On the meta device nn.Embedding's
        # normal_ runs through torch._refs, which imports torch._dynamo and Triton: ~125 MB of RSS a CPU engine
        # would hold for nothing
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: RankShard | None = None):
        """`tp`: this rank of a tensor-parallel group (pdserve.engine.tp): the modules hold the rank's heads, FFN
        columns and vocabulary rows (`config` stays the whole model's)."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        local = cfg if tp is None else _tp_local_config(cfg, tp)
        self.model = DecoderModel(local)
        self.lm_head = nn.Linear(cfg.hidden_size, local.vocab_size, bias=False)
        if tp is not None:
            _use_tp_layers(self, tp)
        self.rotary: RotaryEmbedding | None = None  # set by load_model on the real device
        self.kernels = KernelChoice()
        # Called with layer i once layer i's K/V are written (the KV handoff's layer-group export, installed for the
        # steps whose pages stream layer by layer; None otherwise: nothing is called).
        self.layer_hook: Callable[[int], None] | None = None

    def use_kernels(self, choice: KernelChoice) -> None:
        """Hand `choice` to every module (load time; the bench re-chooses, then re-captures its graphs)."""
        if choice.fused:
            assert self.rotary is not None, "load_model sets the rotary embedding before choosing kernels"
            if self.rotary.cos is None:
                self.rotary.build_tables(self.config.max_position_embeddings)
        for m in self.modules():
            if isinstance(m, (CausalLM, Attention, MLP)):
                m.kernels = choice

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: KVCache, backend) -> torch.Tensor:
        """input_ids [T] -> final hidden states [T, hidden] (after the last norm). The residual stream lives in
        `residual`, updated in place by each add + RMSNorm."""
        residual = self.model.embed_tokens(input_ids)  # [T, hidden]
        h = self.first_norm(residual)
        hook = self.layer_hook
        for i, layer in enumerate(self.decoder_layers):
            a = layer.self_attn(h, meta, self.rotary, cache, backend)
            if hook is not None:  # layer i's K/V are in the pool (written before its attention)
                hook(i)
            h = self.after_attention(i, a, residual)
        assert isinstance(h, torch.Tensor)  # the last norm feeds the LM head: never quantized
        return h

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        return cast(Sequence[DecoderLayer], self.model.layers)

    def first_norm(self, residual: torch.Tensor) -> torch.Tensor | Fp8Activation:
        """The first layer's input norm of the embeddings `residual` [T, hidden]. Each norm's output feeds one
        projection; an FP8 one may take it quantized by the norm (`norm_for`)."""
        layer = self.decoder_layers[0]
        return norm_for(self.kernels, residual, None, layer.input_layernorm, layer.self_attn.qkv_proj)

    def after_attention(self, i: int, a: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | Fp8Activation:
        """Layer i past its attention output `a` [T, hidden]: residual += a; residual += MLP(norm(residual)) (in
        place); returns the next layer's input norm of the residual (after the last layer: the final norm)."""
        kc, layers = self.kernels, self.decoder_layers
        layer = layers[i]
        h = norm_for(kc, a, residual, layer.post_attention_layernorm, layer.mlp.gate_up_proj)
        m = layer.mlp(h)
        last = i + 1 == len(layers)
        norm = self.model.norm if last else layers[i + 1].input_layernorm
        return norm_for(kc, m, residual, norm, None if last else layers[i + 1].self_attn.qkv_proj)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        logits = project(self.kernels, self.lm_head, hidden, "lm_head").float()  # [N, vocab or this rank's part]
        if self.tp is None:
            return logits
        from pdserve.engine.tp.layers import gather_logits

        return gather_logits(logits, self.tp)


def _tp_local_config(cfg: ModelConfig, tp: RankShard) -> ModelConfig:
    from pdserve.engine.tp.layout import local_config

    return local_config(cfg, tp.rank)


def _use_tp_layers(model: CausalLM, tp: RankShard) -> None:
    """A tensor-parallel rank's collectives: all-reduce after o_proj and down_proj, the vocabulary-parallel
    embedding (the LM head's gather is in `compute_logits`)."""
    from pdserve.engine.tp.layers import VocabParallelEmbedding

    start, stop = tp.rank.vocab
    embedding = VocabParallelEmbedding(start, stop - start, model.config.hidden_size, tp.group)
    model.model.embed_tokens = embedding  # type: ignore[assignment]  # an nn.Embedding's drop-in (weight, forward)
    for m in model.modules():
        if isinstance(m, (Attention, MLP)):
            m.tp = tp.group


_CONCATENATED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PROJECTIONS = tuple(
    f".{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)


def _concatenate_projections(state: dict[str, torch.Tensor], block: tuple[int, int] | None) -> None:
    """HF names -> this model's: `...self_attn.{q,k,v}_proj.*` become `...self_attn.qkv_proj.*` (rows
    concatenated), `...mlp.{gate,up}_proj.*` become `...mlp.gate_up_proj.*` (in place). FP8 weights bring their
    scales: per-channel and per-block scales concatenate; when a part but the last does not fill whole blocks of
    rows (e.g. SmolLM2's 576-row q), the parts' block scales are first spread to one scale per row per 128
    columns (`scale_rows(...) == 1`); static input scales merge into their largest (the parts share one input)."""
    for first in [n for n in state if n.endswith((".q_proj.weight", ".gate_proj.weight"))]:
        prefix, part, _ = first.rsplit(".", 2)
        fused = "qkv_proj" if part == "q_proj" else "gate_up_proj"
        parts = [f"{prefix}.{p}" for p in _CONCATENATED[fused]]
        if not all(f"{p}.weight" in state for p in parts):
            continue
        weights = [state[f"{p}.weight"] for p in parts]
        if len({w.dtype for w in weights}) != 1:
            raise ValueError(f"{parts}: weights of different dtypes ({[w.dtype for w in weights]}) cannot fuse")
        if block is not None and weights[0].dtype == FP8 and any(w.shape[0] % block[0] for w in weights[:-1]):
            for p, w in zip(parts, weights):  # [ceil(rows / bn), KG] -> [rows, KG]
                state[f"{p}.weight_scale"] = state[f"{p}.weight_scale"].repeat_interleave(block[0], 0)[: w.shape[0]]
        for kind in ("weight", "bias", "weight_scale", "input_scale"):
            names = [f"{p}.{kind}" for p in parts]
            present = [n in state for n in names]
            if not any(present):
                continue
            if not all(present):
                raise ValueError(f"{prefix}: {kind} on only some of {parts}")
            tensors = [state.pop(n) for n in names]
            merged = torch.stack(tensors).amax() if kind == "input_scale" else torch.cat(tensors)
            state[f"{prefix}.{fused}.{kind}"] = merged
        weights = tensors = []  # the parts' last references
        if state[f"{prefix}.{fused}.weight"].is_cuda:  # the parts' blocks back to the device now: the next fused
            torch.cuda.empty_cache()  # weight would be placed in one of them, and the rest of it stay reserved


def _read_state(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    scheme: Fp8Scheme | None,
    online: bool,
    dummy: ModelConfig | None = None,
    shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    keep_fp8: bool = False,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by HF name, FP8 ones with `weight_scale` (fp8_checkpoint.normalize_state).
    `online`: each projection weight quantized per channel as it streams in (peak memory: the FP8 model plus one
    bf16 tensor; on CPU dequantized back at once, so the CPU model carries the rounding, unless `keep_fp8`).
    `dummy`: random tensors of that config's shape instead of the checkpoint's (load_format "dummy",
    loader.iter_dummy_weights).
    `shard`: (name, full tensor) -> this tensor-parallel rank's part (tp.shard.RankSharder), applied as each
    tensor streams in (after online quantization, so every rank holds the TP=1 model's values)."""
    state: dict[str, torch.Tensor] = {}
    keep = shard or (lambda _name, x: x)
    tensors = iter_dummy_weights(dummy, device, dtype) if dummy is not None else iter_weights(model_dir, device, dtype)
    for name, t in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if online and name.endswith(_PROJECTIONS):
            q, scale = quantize_weight_per_channel(t)
            if device.type == "cuda" or keep_fp8:
                scale_name = name.removesuffix(".weight") + ".weight_scale"
                state[scale_name] = keep(scale_name, scale)
                t = q
            else:
                t = dequantize_weight(q, scale, None, dtype)
        state[name] = keep(name, t)
    if scheme is not None and not online:
        normalize_state(state, scheme)
    return state


def scale_rows(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> int:
    """Rows of `weight` [N, K] one block scale covers: the scheme's block rows, or 1 when `scale` has a row per
    weight row (spread by `_concatenate_projections`)."""
    assert scheme.block_size is not None
    bn = scheme.block_size[0]
    return bn if scale.shape[0] == -(-weight.shape[0] // bn) else 1


def _dequantize_state(state: dict[str, torch.Tensor], scheme: Fp8Scheme, dtype: torch.dtype) -> None:
    """Every FP8 weight -> `dtype` (w = q * scale, the product in float32), its scales dropped (in place)."""
    for name in [n for n in state if n.endswith(".weight") and state[n].dtype == FP8]:
        prefix = name.removesuffix(".weight")
        w, scale = state[name], state.pop(f"{prefix}.weight_scale")
        state.pop(f"{prefix}.input_scale", None)
        block = None if scheme.block_size is None else (scale_rows(w, scale, scheme), scheme.block_size[1])
        state[name] = dequantize_weight(w, scale, block, dtype)


def _use_fp8_layers(model: CausalLM, state: dict[str, torch.Tensor], scheme: Fp8Scheme, triton: bool) -> int:
    """Swap every nn.Linear whose weight in `state` is FP8 for an `Fp8Linear` (meta device); returns how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        w = state.get(f"{name}.weight")
        if isinstance(module, nn.Linear) and w is not None and w.dtype == FP8:
            parent, _, attr = name.rpartition(".")
            rows = scale_rows(w, state[f"{name}.weight_scale"], scheme) if scheme.weights == "block" else 0
            layer = Fp8Linear(module.in_features, module.out_features, module.bias is not None, scheme, rows)
            layer.triton = triton
            setattr(model.get_submodule(parent) if parent else model, attr, layer)
            swapped += 1
    return swapped


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    choice: KernelChoice,
    quantization: str = "none",
    load_format: str = "auto",
    tp: RankShard | None = None,
    fp8_reference: bool = False,
) -> CausalLM:
    """Build the model on the meta device and assign the checkpoint's tensors by name (strict), q/k/v and gate/up
    concatenated; the modules then run the kernels of `choice`. FP8: the checkpoint's own format
    (`cfg.quantization`), else `quantization="fp8"` quantizes the projections at load (per channel, dynamic
    per-token activations); an FP8 checkpoint keeps its format either way. `load_format="dummy"`: random weights
    made on `device` from `cfg` alone (no safetensors read). `tp`: load this tensor-parallel rank's part only
    (pdserve.engine.tp; tied embeddings share the embedding's vocabulary slice). `fp8_reference` (CPU): keep the
    FP8 projections as `Fp8Linear` layers running `Fp8Linear.reference`, the GPU's quantized math with its
    activation quantization, instead of dequantizing them at load (slow: the quality bench and tests only)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    online = cfg.quantization is None and quantization == "fp8"
    scheme = cfg.quantization or (ONLINE_FP8 if online else None)
    if scheme is not None and device.type == "cuda" and choice.invariant_gemm:
        raise ValueError(
            "batch_invariant is not supported with FP8 weights on CUDA (their GEMMs pick kernels by shape)"
        )
    triton = choice.triton_kv_quant  # EngineConfig.triton and triton usable on this device
    if scheme is not None and device.type == "cuda" and scheme.weights == "block" and not triton:
        raise ValueError("block-scaled FP8 weights on CUDA need the Triton kernels (triton=true)")
    with torch.device("meta"):
        model = CausalLM(cfg, tp)
    shard = None
    if tp is not None:
        from pdserve.engine.tp.shard import RankSharder

        shard = RankSharder(cfg, tp.layout, tp.group.rank)
    dummy = cfg if load_format == "dummy" else None
    state = _read_state(model_dir, device, dtype, scheme, online, dummy, shard, keep_fp8=fp8_reference)
    if "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings:
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    _concatenate_projections(state, scheme.block_size if scheme is not None else None)
    if scheme is not None and (device.type == "cuda" or fp8_reference):
        with torch.device("meta"):
            _use_fp8_layers(model, state, scheme, triton)
    elif scheme is not None:  # CPU: dequantized once here (per-call dequantization would redo it every step)
        _dequantize_state(state, scheme, dtype)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {cfg.arch}: missing {missing[:8]}, unexpected {unexpected[:8]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
    model = model.eval().requires_grad_(False)
    model.use_kernels(choice)
    return model
