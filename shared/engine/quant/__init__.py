"""FP8 weights: checkpoint formats (`fp8_checkpoint`), quantizers (`fp8_quant`), the linear layer that runs them
(`fp8_linear`), the block-scaled Triton GEMM (`fp8_block_gemm`) and the decode GEMV (`fp8_gemv`). docs/fp8.md says
which checkpoints load and what each path costs."""
