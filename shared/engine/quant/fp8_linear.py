"""`Fp8Linear`: a linear layer over e4m3 weights with float32 scales, run on Hopper tensor cores.

- per-channel weights (online FP8, compressed-tensors): activations quantized per token (or with the checkpoint's
  static scale), then `torch._scaled_mm` with rowwise scales: scale_a [M, 1] and scale_b [1, N] float32, the
  weight stored [N, K] row-major, which is the column-major [K, N] operand `_scaled_mm` wants (`weight.t()`).
- block-scaled weights (DeepSeek / Qwen3 `-FP8`): activations quantized per token per 128 columns, then
  `torch._scaled_mm` with block scales (cuBLAS: scale_a [M, K/128] column-major, scale_b the transpose of the
  [N/128, K/128] weight scales) where N and K are multiples of 128 and this torch / GPU runs it (`block_backend`
  "auto": tried eagerly, the Triton block GEMM `fp8_block_gemm` for good after a refusal), else the Triton GEMM.
- decode-sized batches (<= `gemv_max_rows` tokens), either layout: the weight-only GEMV (`fp8_gemv`), activations
  unquantized, reading the e4m3 weights near copy bandwidth (split-K in one launch, tickets in `gemv_counters`).
- decode batches above that (<= `skinny_max_rows` tokens), either layout: per projection shape and batch size, the
  split-K Triton GEMM (`fp8_block_gemm.SKINNY_CONFIGS`: narrow column tiles, split-K, quantized activations) where
  it beat cuBLAS in bench/fp8_gemm_sweep.py, else cuBLAS as above.
Every op is a device launch without host syncs: the layer runs inside the decode CUDA graphs.

Per-token inputs may come quantized already (`Fp8Activation`): the model's RMSNorm (qkv, gate_up inputs) and SwiGLU
(down input) kernels write e4m3 + one scale per row in the pass that makes them (`takes_fp8` says when a layer
wants that), so prefill reads no bf16 copy of those inputs back for a separate quantization pass.
`fast_accum`: the rowwise / per-tensor `_scaled_mm` accumulates as cuBLAS / CUTLASS FP8 "fast accumulation" does
(no periodic promotion of the tensor cores' partial sums to float32 inside the K loop), as vLLM's CUTLASS FP8 GEMMs
for per-tensor / per-channel scales do on Hopper (`...FP8FastAccum` kernel schedules); the block-scaled GEMMs apply
their scales per 128 columns of K, promoting anyway.

The engine builds this module on CUDA only; on CPU it dequantizes FP8 weights once at load (model.py). `forward`
on a CPU tensor runs `reference`: the same quantized math in float32, for tests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from pdserve.engine.quant.fp8_checkpoint import Fp8Scheme
from pdserve.engine.quant.fp8_quant import (
    FP8,
    dequantize_weight,
    quantize_activations,
    quantize_activations_static,
    quantize_activations_torch,
)

# decode batches: a few tokens' GEMM is bound by the weight bytes, and quantizing the activations first only adds a
# launch; up to this many tokens take the weight-only GEMV (fp8_gemv); bench/fp8_weights.py times both
GEMV_MAX_ROWS = 16  # = fp8_gemv.MAX_M, the most the GEMV takes
SKINNY_MAX_ROWS = 256  # = fp8_block_gemm.SKINNY_MAX_ROWS, the most rows its split-K configs are made for


class Fp8Activation(NamedTuple):
    """A GEMM input quantized per token by the kernel that produced it (kernels/rmsnorm.py, kernels/silu_mul.py)."""

    q: torch.Tensor  # [T, K] e4m3
    scale: torch.Tensor  # [T, 1] float32: x ≈ q * scale
    dtype: torch.dtype  # the unquantized activations' dtype (the layer's output dtype)


class Fp8Linear(nn.Module):
    weight: torch.Tensor  # [N, K] e4m3
    weight_scale: torch.Tensor  # float32 [N] (per channel) or [ceil(N/bn), ceil(K/bk)] (per block)
    input_scale: torch.Tensor | None  # float32 [] (static activations)
    bias: torch.Tensor | None  # [N]

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Fp8Scheme, scale_rows: int = 0):
        """`scale_rows` (block scheme): rows one weight scale covers, when not the scheme's block rows (1: a fused
        projection whose parts do not fill whole blocks keeps one scale per row per 128 columns)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block: tuple[int, int] | None = None
        if scheme.weights == "block":
            assert scheme.block_size is not None
            self.block = (scale_rows or scheme.block_size[0], scheme.block_size[1])
        self.static_input = scheme.activations == "static"
        self.triton = True  # CUDA: activations quantized by the Triton kernel (False: torch ops; block needs it)
        # CUDA with triton: up to this many tokens through the weight-only GEMV (`fp8_gemv`), more through
        # _scaled_mm (per channel) or the block GEMM; 0: never the GEMV
        self.gemv_max_rows = GEMV_MAX_ROWS
        # block scheme above the GEMV: "auto" (cuBLAS block-scaled _scaled_mm where it runs, else triton) |
        # "scaled_mm" | "triton" (the Triton block GEMM)
        self.block_backend = "auto"
        # CUDA with triton: batches above the GEMV up to this many tokens may take the split-K Triton GEMM where its
        # table says it beats cuBLAS (`_skinny`); 0: cuBLAS wherever it takes the shape
        self.skinny_max_rows = SKINNY_MAX_ROWS
        # int32 split-K tickets of the GEMV and the skinny GEMM (zero between calls: both leave them zero)
        self.gemv_counters: torch.Tensor | None = None
        self.fast_accum = True  # per-channel / per-tensor `_scaled_mm` with fast accumulation (module docstring)
        # inputs quantized by the producing RMSNorm / SwiGLU kernel (`Fp8Activation`): on the H200 one 8B layer's
        # projections at 8192 tokens take 2.97 ms fused against 3.12 ms with the separate quantizer pass (SwiGLU
        # single pass 0.157 ms vs 0.268 unfused, RMSNorm 0.063 vs 0.099; test_engine_gpu_fp8_fusion.py times them)
        self.fused_input = True
        # fp8_gemv's path for the GEMV's rows ("auto" where the path named cannot take them); a bench knob
        # (bench/diag/decode_kernels.py --gemv-ab)
        self.gemv_path = "auto"
        # "stream" only: e4m3 widened by integer ops (fp8_gemv's `bits`; None: as its config says); a bench knob
        self.gemv_bits: bool | None = None
        # "stream" only: products in packed float16 (fp8_gemv's `half`; None: as its config says); a bench knob
        self.gemv_half: bool | None = None
        n, k = out_features, in_features
        self.register_buffer("weight", torch.empty(n, k, dtype=FP8))  # [N, K] e4m3
        scale_shape = (n,) if self.block is None else (-(-n // self.block[0]), -(-k // self.block[1]))
        self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32))
        self.register_buffer("input_scale", torch.empty((), dtype=torch.float32) if self.static_input else None)
        self.register_buffer("bias", torch.empty(n) if bias else None)

    def extra_repr(self) -> str:
        w = f"block={self.block}" if self.block else "per-channel"
        return f"in={self.in_features}, out={self.out_features}, {w}, static_input={self.static_input}"

    def takes_fp8(self, rows: int) -> bool:
        """Whether a CUDA input of `rows` tokens may come as an `Fp8Activation`: per-channel weights with dynamic
        per-token activations, above the GEMV's rows (the GEMV reads unquantized activations)."""
        return (
            self.fused_input
            and self.triton
            and self.block is None
            and self.input_scale is None
            and rows > min(self.gemv_max_rows, GEMV_MAX_ROWS)
        )

    def forward(self, x: torch.Tensor | Fp8Activation, pdl: bool = False) -> torch.Tensor:
        """x [T, K] (or that quantized per token, see `takes_fp8`) -> [T, N] in x's dtype. `pdl`: the GEMV as a
        programmatic dependent launch (Hopper)."""
        if isinstance(x, Fp8Activation):
            assert self.block is None and self.input_scale is None, "per-token inputs suit per-channel layers only"
            if not x.q.is_cuda:
                return self.reference(x)
            return self._rowwise(x.q, x.scale, x.dtype)
        if not x.is_cuda:
            return self.reference(x)
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if self.triton and x.shape[0] <= min(self.gemv_max_rows, GEMV_MAX_ROWS):
            from pdserve.engine.quant.fp8_gemv import fp8_gemv, takes

            scale_rows = 0 if self.block is None else self.block[0]
            path = self.gemv_path
            if path != "auto" and not takes(path, x.shape[0], x.dtype):
                path = "auto"
            return fp8_gemv(x, self.weight, self.weight_scale, self.bias, scale_rows, pdl=pdl, path=path,
                            counters=self._tickets(x.device), bits=self.gemv_bits, half=self.gemv_half)  # fmt: skip
        if self.block is not None:
            out = self._block_gemm(x)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.to(x.dtype)
        if self.input_scale is not None:
            xq = quantize_activations_static(x, self.input_scale)
            xs = self.input_scale.expand(x.shape[0], 1).contiguous()  # [T, 1]: _scaled_mm wants rowwise pairs
        else:
            quant = quantize_activations if self.triton else quantize_activations_torch
            xq, xs = quant(x, None)  # [T, K] e4m3, [T, 1]
        return self._rowwise(xq, xs, x.dtype)

    def _tickets(self, device: torch.device) -> torch.Tensor | None:
        """The split-K tickets, allocated eagerly (warm-up) and reused by the graphs (None while capturing before
        any eager call: the kernels then take a zeroed tensor of their own)."""
        from pdserve.engine.quant import fp8_block_gemm, fp8_gemv

        if self.gemv_counters is None and not torch.cuda.is_current_stream_capturing():
            n = self.out_features
            slots = max(fp8_gemv.counter_slots(n), fp8_block_gemm.counter_slots(SKINNY_MAX_ROWS, n))
            self.gemv_counters = torch.zeros(slots, dtype=torch.int32, device=device)
        return self.gemv_counters

    def _skinny(self, rows: int, device: torch.device, cublas: bool = True) -> dict | None:
        """The split-K Triton GEMM's launch config for a quantized batch of `rows` tokens, or None: cuBLAS (where
        `cublas`: it takes the shape) or the prefill tiles run it (fp8_block_gemm.SKINNY_CONFIGS says which)."""
        from pdserve.engine.quant import fp8_block_gemm as G

        if not (self.triton and rows <= min(self.skinny_max_rows, SKINNY_MAX_ROWS)):
            return None
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return G.skinny_config(rows, self.out_features, self.in_features, self.block is None, sms, cublas)

    def _rowwise(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Per-channel / per-tensor weights: xq [T, K] e4m3, xs [T, 1] float32 -> [T, N] in `dtype`."""
        config = self._skinny(xq.shape[0], xq.device)
        if config is not None:
            from pdserve.engine.quant.fp8_block_gemm import channel_gemm

            out = channel_gemm(xq, xs, self.weight, self.weight_scale, config=config, counters=self._tickets(xq.device))
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.to(dtype)
        out = torch._scaled_mm(
            xq,
            self.weight.t(),
            scale_a=xs,
            scale_b=self.weight_scale.view(1, -1),
            out_dtype=torch.bfloat16,
            use_fast_accum=self.fast_accum,
        )
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(dtype)

    def _block_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Block scheme, x [T, K] -> [T, N] bf16: activations quantized per token per 128 columns (one Triton
        launch), then cuBLAS's block-scaled `_scaled_mm` or the Triton block GEMM (`block_backend`)."""
        from pdserve.engine.quant.fp8_block_gemm import block_gemm

        assert self.block is not None
        m = x.shape[0]
        cublas = self.block_backend != "triton" and self._cublas_block_shape(m)
        config = self._skinny(m, x.device, cublas)  # where cuBLAS cannot take M: the split-K GEMM all the same
        if config is None and cublas:
            xq, xs = quantize_activations(x, self.block[1], col_major=True)  # [T, K] e4m3, [T, K/128] col-major
            try:  # scale_b: [K/128, N/128], the transpose of the checkpoint's [N/128, K/128] (a view)
                return torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale.t(),
                                        out_dtype=torch.bfloat16)  # fmt: skip
            except (RuntimeError, NotImplementedError, ValueError):
                if self.block_backend == "scaled_mm" or torch.cuda.is_current_stream_capturing():
                    raise
                self.block_backend = "triton"  # this torch / GPU has no block-scaled _scaled_mm
        xq, xs = quantize_activations(x, self.block[1])  # [T, K] e4m3, [T, K/128] (Triton)
        return block_gemm(xq, xs, self.weight, self.weight_scale, out_dtype=torch.bfloat16, config=config,
                          scale_rows=self.block[0], counters=self._tickets(x.device) if config else None)  # fmt: skip

    def _cublas_block_shape(self, m: int) -> bool:
        """Whether cuBLAS's block-scaled `_scaled_mm` takes this layer at `m` tokens: only where both scale grids have
        whole groups of 4 blocks and M whole tiles of 16, the shapes its kernels cover; outside them it refuses some
        shapes and returns wrong products for others without an error (the GPU tests check both sides), so every
        other shape takes the Triton block GEMM."""
        from pdserve.engine.quant.fp8_block_gemm import SCALE_BLOCK

        n_blocks, k_blocks = self.out_features // SCALE_BLOCK, self.in_features // SCALE_BLOCK
        return (
            self.block == (SCALE_BLOCK, SCALE_BLOCK)
            and self.out_features % SCALE_BLOCK == 0
            and self.in_features % SCALE_BLOCK == 0
            and n_blocks % 4 == 0
            and k_blocks % 4 == 0
            and m % 16 == 0
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] weight in `dtype` (what the CPU path runs)."""
        return dequantize_weight(self.weight, self.weight_scale, self.block, dtype)

    def reference(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        """The GPU path's math in float32 torch ops: activations quantized as there, both operands dequantized,
        one float32 matmul (batches of <= `gemv_max_rows` tokens on the GPU skip the activation quantization:
        theirs is `x @ dequantized_weight().t()`). x [T, K] (or quantized already) -> [T, N] in x's dtype."""
        if isinstance(x, Fp8Activation):
            out = (x.q.float() * x.scale) @ self.dequantized_weight(torch.float32).t()
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(x.dtype)
        if self.block is not None:
            xq, xs = quantize_activations_torch(x, self.block[1])
            xd = xq.float() * xs.repeat_interleave(self.block[1], 1)[:, : x.shape[1]]
        elif self.input_scale is not None:
            xd = quantize_activations_static(x, self.input_scale).float() * self.input_scale
        else:
            xq, xs = quantize_activations_torch(x, None)
            xd = xq.float() * xs
        out = xd @ self.dequantized_weight(torch.float32).t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)
