"""A CPU engine whose FP8 layers run the GPU's quantized math (`Fp8Linear.reference`: activations quantized per token,
or per token per 128 columns for block weights) instead of the weights dequantized at load (what a CPU engine runs):
the quality bench's w8a8 perplexity (bench/fp8_weights.py --ppl) and its tests."""

from __future__ import annotations

from pdserve.engine.engine import LLMEngine
from pdserve.engine.model import load_model
from pdserve.engine.quant.fp8_linear import Fp8Linear


def use_fp8_reference(engine: LLMEngine) -> int:
    """Reload `engine`'s model (CPU, FP8 checkpoint or online FP8) with its FP8 projections kept as `Fp8Linear`
    layers; returns how many there are (0: the model has no FP8 weights, and nothing changed)."""
    runner, cfg = engine.runner, engine.cfg
    if runner.device.type != "cpu":
        raise ValueError("the FP8 reference math is for CPU engines (a GPU engine runs FP8 layers already)")
    model = load_model(cfg.model_dir, engine.model_config, runner.device, runner.dtype, runner.kernels,
                       cfg.quantization, cfg.load_format, fp8_reference=True)  # fmt: skip
    layers = sum(isinstance(m, Fp8Linear) for m in model.modules())
    if layers:
        runner.model = model
    return layers
