"""Write an FP8 copy of a local bf16/fp32 checkpoint in the layouts real FP8 checkpoints ship (tests and the
benchmark's perplexity rows build their FP8 models with it; no model hub needed).

Formats: "block" (quant_method fp8, weight_block_size [128, 128], `weight_scale_inv` per block, as DeepSeek-V3/R1
and Qwen3 -FP8), "channel" (compressed-tensors, `weight_scale` [N, 1], dynamic per-token activations), "tensor"
(compressed-tensors, one `weight_scale` and one static `input_scale` per projection; the input scale is a stand-in
computed from the weights, as the tests need a value, not a calibration)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from pdserve.engine.quant.fp8_checkpoint import Fp8Scheme
from pdserve.engine.quant.fp8_quant import FP8_MAX, quantize_weight_blocks, quantize_weight_per_channel

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = ("block", "channel", "tensor")
STATIC_INPUT_SCALE = 0.05  # "tensor" format stand-in: covers activations up to 0.05 * 448 = 22.4 in magnitude


def quantization_config(fmt: str) -> dict:
    """config.json's `quantization_config` for `fmt`."""
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    static = fmt == "tensor"
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": fmt, "symmetric": True, "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "tensor" if static else "token",
                    "symmetric": True,
                    "dynamic": not static,
                },
            }
        },
    }


def quantize_tensors(name: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """One projection weight [N, K] -> the tensors an FP8 checkpoint of `fmt` holds for it."""
    prefix = name.removesuffix(".weight")
    if fmt == "block":
        q, scale = quantize_weight_blocks(w)
        return {name: q, f"{prefix}.weight_scale_inv": scale}
    if fmt == "channel":
        q, scale = quantize_weight_per_channel(w)
        return {name: q, f"{prefix}.weight_scale": scale[:, None]}
    scale = w.float().abs().amax().clamp(min=1e-12) / FP8_MAX
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {
        name: q,
        f"{prefix}.weight_scale": scale.reshape(1),
        f"{prefix}.input_scale": torch.tensor([STATIC_INPUT_SCALE]),
    }


RANDOM_Q_STD = 64.0  # random e4m3 codes: standard deviation in e4m3 units (±448 clips at 7 sigma)


def random_tensors(
    name: str, n: int, k: int, std: float, fmt: str, g: torch.Generator, codes: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Random tensors an FP8 checkpoint of `fmt` holds for one projection weight [N, K] (HF `name`), made on the
    generator's device without a bf16 weight first: e4m3 codes ~ N(0, 64^2) and scales std / 64 (dequantized
    weights ~ N(0, std^2)) in the layout of `fmt` (what `quantize_tensors` writes). `codes`: the e4m3 [N, K] codes
    drawn by the caller (the dummy loader draws them rows at a time, loader.RandomFill), else drawn here."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    dev, prefix = g.device, name.removesuffix(".weight")
    if codes is None:
        drawn = torch.randn(n, k, device=dev, generator=g).mul_(RANDOM_Q_STD).clamp_(-FP8_MAX, FP8_MAX)
        codes = drawn.to(torch.float8_e4m3fn)
        del drawn
    q = codes  # [N, K] e4m3
    s = std / RANDOM_Q_STD
    if fmt == "block":
        return {name: q, f"{prefix}.weight_scale_inv": torch.full((-(-n // 128), -(-k // 128)), s, device=dev)}
    if fmt == "channel":
        return {name: q, f"{prefix}.weight_scale": torch.full((n, 1), s, device=dev)}
    return {
        name: q,
        f"{prefix}.weight_scale": torch.full((1,), s, device=dev),
        f"{prefix}.input_scale": torch.full((1,), STATIC_INPUT_SCALE, device=dev),
    }


def scheme_format(scheme: Fp8Scheme) -> str:
    """The `FORMATS` name of a checkpoint scheme (block / channel / tensor: static per-tensor activations)."""
    if scheme.weights == "block":
        return "block"
    return "tensor" if scheme.activations == "static" else "channel"


def convert_checkpoint(src: str | Path, dst: str | Path, fmt: str) -> Path:
    """Copy the model directory `src` to `dst` with every projection weight in FP8 `fmt`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    weight_map: dict[str, str] = {}  # tensor -> shard, for a sharded checkpoint's index
    for path in sorted(src.glob("*.safetensors")):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if name.endswith(tuple(f".{p}.weight" for p in PROJECTIONS)):
                    out.update(quantize_tensors(name, t, fmt))
                else:
                    out[name] = t
        save_file({k: v.contiguous() for k, v in out.items()}, str(dst / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, path.name))
    index = src / "model.safetensors.index.json"
    if index.exists():
        meta = {k: v for k, v in json.loads(index.read_text()).get("metadata", {}).items() if k != "total_size"}
        (dst / index.name).write_text(json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(fmt)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
