"""FP8 checkpoint formats: `quantization_config` parsed into an `Fp8Scheme`, and a checkpoint's FP8 tensors brought
to the names and shapes `Fp8Linear` holds.

Formats read (the checkpoint's `config.json`):
- block-scaled e4m3 (`quant_method: "fp8"`, `weight_block_size: [128, 128]`, DeepSeek-V3/R1, Qwen3 `-FP8`):
  `<proj>.weight` float8_e4m3fn [N, K] and `<proj>.weight_scale_inv` float32 [ceil(N/128), ceil(K/128)];
  w = weight * scale_inv[n // 128, k // 128]; activations quantized at run time per token per 128 columns.
- `compressed-tensors` FP8 (`format: "float-quantized"`): `<proj>.weight` e4m3 [N, K] with `<proj>.weight_scale`
  per output channel [N, 1] (strategy "channel") or one scalar (strategy "tensor"); activations per token at run
  time (`input_activations: {strategy: "token", dynamic: true}`) or with the checkpoint's static per-tensor
  `<proj>.input_scale` (`{strategy: "tensor", dynamic: false}`).
Everything else fails at load with a message that names the variant.

After `normalize_state`, every quantized projection holds `weight` (e4m3 [N, K]), `weight_scale` (float32: [N] per
channel, or [ceil(N/bn), ceil(K/bk)] per block) and, with static activations, `input_scale` (float32 []).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")
SUPPORTED_BLOCK = (128, 128)


@dataclass(frozen=True)
class Fp8Scheme:
    """How FP8 linear weights are scaled and how their activations are quantized."""

    weights: str  # "block" (one scale per block_size tile) | "channel" (per output row; per-tensor is expanded)
    activations: str = "dynamic"  # dynamic: per token (channel) / per token per block_size[1] columns (block);
    # static: the checkpoint's one input_scale per projection
    block_size: tuple[int, int] | None = None  # (rows, columns) of one weight scale tile, block only
    source: str = "online"  # fp8 | compressed-tensors | online (a bf16 checkpoint quantized at load)

    def describe(self) -> str:
        w = f"block {self.block_size[0]}x{self.block_size[1]}" if self.block_size else "per-channel"
        return f"fp8 e4m3 ({self.source}): weights {w}, activations {self.activations}"


ONLINE_FP8 = Fp8Scheme(weights="channel", activations="dynamic", source="online")


def parse_quantization_config(qc: dict | None) -> Fp8Scheme | None:
    """config.json's `quantization_config` -> the scheme (None: an unquantized checkpoint); raise
    NotImplementedError naming any variant this engine does not run."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_block_fp8(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise NotImplementedError(
        f"quantization_config quant_method {method!r} is not supported (supported: 'fp8' with weight_block_size "
        "[128, 128], 'compressed-tensors' FP8 per-channel / per-tensor)"
    )


def _parse_block_fp8(qc: dict) -> Fp8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise NotImplementedError(f"quant_method 'fp8' with fmt {fmt!r} is not supported (only e4m3)")
    block = qc.get("weight_block_size")
    if block is None:
        raise NotImplementedError(
            "quant_method 'fp8' without weight_block_size (per-tensor FP8 with weight_scale) is not supported; "
            "supported: weight_block_size [128, 128]"
        )
    if tuple(block) != SUPPORTED_BLOCK:
        raise NotImplementedError(
            f"quant_method 'fp8' weight_block_size {list(block)} is not supported (only [128, 128])"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise NotImplementedError(
            f"quant_method 'fp8' activation_scheme {scheme!r} is not supported with block scales (only 'dynamic')"
        )
    return Fp8Scheme(weights="block", activations="dynamic", block_size=SUPPORTED_BLOCK, source="fp8")


def _parse_compressed_tensors(qc: dict) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise NotImplementedError(
            f"compressed-tensors format {fmt!r} is not supported (only 'float-quantized' FP8 weights)"
        )
    if qc.get("kv_cache_scheme"):
        raise NotImplementedError(
            "compressed-tensors kv_cache_scheme is not supported (the engine quantizes KV itself: --kv-dtype)"
        )
    groups = qc.get("config_groups") or {}
    schemes = {_parse_ct_group(name, g) for name, g in groups.items()}
    if len(schemes) != 1:
        raise NotImplementedError(
            f"compressed-tensors with {len(groups)} config_groups of different schemes is not supported "
            "(one FP8 scheme for every Linear)"
        )
    return schemes.pop()


def _parse_ct_group(name: str, g: dict) -> Fp8Scheme:
    targets = g.get("targets") or []
    if "Linear" not in targets:
        raise NotImplementedError(f"compressed-tensors config_groups[{name!r}] targets {targets} (only 'Linear')")
    w = g.get("weights") or {}
    what = f"compressed-tensors config_groups[{name!r}]"
    if (w.get("type"), w.get("num_bits")) != ("float", 8):
        raise NotImplementedError(
            f"{what} weights type {w.get('type')!r} num_bits {w.get('num_bits')} are not supported "
            "(only type 'float' num_bits 8: FP8 e4m3)"
        )
    if w.get("strategy") not in ("channel", "tensor") or w.get("dynamic") or not w.get("symmetric", True):
        raise NotImplementedError(
            f"{what} weights strategy {w.get('strategy')!r} (dynamic={w.get('dynamic')}, "
            f"symmetric={w.get('symmetric', True)}) is not supported (only static symmetric 'channel' or 'tensor')"
        )
    a = g.get("input_activations")
    if not a:
        raise NotImplementedError(f"{what}: weight-only FP8 (input_activations null) is not supported")
    if (a.get("type"), a.get("num_bits")) != ("float", 8) or not a.get("symmetric", True):
        raise NotImplementedError(
            f"{what} input_activations type {a.get('type')!r} num_bits {a.get('num_bits')} is not supported "
            "(only symmetric FP8)"
        )
    strategy, dynamic = a.get("strategy"), bool(a.get("dynamic"))
    if (strategy, dynamic) == ("token", True):
        activations = "dynamic"
    elif (strategy, dynamic) == ("tensor", False):
        activations = "static"
    else:
        raise NotImplementedError(
            f"{what} input_activations strategy {strategy!r} dynamic={dynamic} is not supported "
            "(only 'token' dynamic or 'tensor' static)"
        )
    return Fp8Scheme(weights="channel", activations=activations, source="compressed-tensors")


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIXES)


def normalize_state(state: dict[str, torch.Tensor], scheme: Fp8Scheme) -> None:
    """A loaded checkpoint's FP8 tensors (in place) -> `weight_scale` per `Fp8Linear`: block scales renamed from
    `weight_scale_inv`; channel scales [N, 1] -> [N]; per-tensor scalars expanded to [N] (so q/k/v and gate/up,
    each with its own scalar, concatenate into one per-channel layer); `input_scale` -> float32 []."""
    for name in [n for n in state if n.endswith(".weight") and state[n].dtype == torch.float8_e4m3fn]:
        prefix = name.removesuffix(".weight")
        n_rows, k = state[name].shape
        if scheme.weights == "block":
            scale = state.pop(f"{prefix}.weight_scale_inv", None)
            bn, bk = scheme.block_size or SUPPORTED_BLOCK
            want = (-(-n_rows // bn), -(-k // bk))
            if scale is None or tuple(scale.shape) != want:
                got = None if scale is None else tuple(scale.shape)
                raise ValueError(
                    f"{prefix}: block-scaled FP8 weight [{n_rows}, {k}] needs weight_scale_inv {want}, got {got}"
                )
        else:
            scale = state.pop(f"{prefix}.weight_scale", None)
            if scale is None or scale.numel() not in (1, n_rows):
                got = None if scale is None else tuple(scale.shape)
                raise ValueError(
                    f"{prefix}: FP8 weight [{n_rows}, {k}] needs weight_scale [{n_rows}, 1] or [], got {got}"
                )
            scale = scale.reshape(-1).expand(n_rows) if scale.numel() == 1 else scale.reshape(n_rows)
        state[f"{prefix}.weight_scale"] = scale.float().contiguous()
        if scheme.activations == "static":
            s = state.get(f"{prefix}.input_scale")
            if s is None or s.numel() != 1:
                raise ValueError(f"{prefix}: static FP8 activations need a scalar input_scale")
            state[f"{prefix}.input_scale"] = s.float().reshape(())
        else:  # dynamic: a calibration scale some exporters keep is not used
            state.pop(f"{prefix}.input_scale", None)

    def fp8_weight(scale_name: str) -> bool:
        w = state.get(scale_name[: scale_name.rindex(".")] + ".weight")
        return w is not None and w.dtype == torch.float8_e4m3fn

    stray = [n for n in state if is_scale_name(n) and not fp8_weight(n)]
    if stray:
        raise ValueError(f"scales without an FP8 weight: {stray[:4]}")
