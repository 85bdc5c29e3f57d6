"""Which kernels the model, the KV pool and attention run: chosen once at load from EngineConfig and the device,
then held by the modules (one module tree, one forward path; the choice decides what each op calls).

CPU (and CUDA with `triton=False`) keeps plain torch ops. CUDA with triton runs the fused path: q/k/v and
gate/up as one GEMM each (the weights are stored that way on every device), RMSNorm fused with the residual add,
RoPE fused with the KV write, SwiGLU in one kernel, Triton GEMVs for decode rows, int8 KV (de)quantization in
Triton. Both paths give the same math with the same bf16 roundings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.engine import kernels
from pdserve.engine.config import GEMV_PROJECTIONS, EngineConfig
from pdserve.engine.loader import ModelConfig
from pdserve.kv import quant

GEMV_MAX_ROWS = 4  # x with at most this many rows may take the Triton GEMV (kernels/gemv.py MAX_M)


def fusable(mc: ModelConfig) -> bool:
    """The fused kernels need power-of-two head_dim (>= 16) and KV head count (tl.arange)."""
    return kernels.is_pow2(mc.head_dim) and mc.head_dim >= 16 and kernels.is_pow2(mc.num_kv_heads)


@dataclass(frozen=True)
class KernelChoice:
    fused: bool = False  # Triton model kernels (fused path); False: torch ops
    triton_kv_quant: bool = False  # int8 / fp8 KV quantize/dequantize through Triton (bit-identical to torch)
    pdl: bool = False  # Triton kernels launched as programmatic dependent launches
    gemv: dict[str, dict | None] = field(default_factory=dict)  # fused path, <= 4 rows: projection -> config
    int8_decode: str = "triton"  # FA3 backend, quantized pool (int8 | fp8), decode: triton | dequant
    dense_decode: str = "triton"  # FA3 backend, dense pool, decode: triton | fa3
    dense_prefill: str = "paged"  # FA3 backend, dense pool, prefill: paged | gather
    fa3_num_splits: int = 4
    decode_config: dict = field(default_factory=dict)  # Triton decode-attention config overrides
    invariant_rows: int = 0  # > 0 (batch_invariant, CPU path): linear layers run in blocks of exactly this many rows
    invariant_gemm: bool = False  # batch_invariant, CUDA: linear layers through kernels/invariant_matmul.py, and
    # attention (prefill rows too) through the Triton decode kernel with INVARIANT_SPLITS splits (attention.py)

    @classmethod
    def select(cls, cfg: EngineConfig, device: torch.device, mc: ModelConfig) -> KernelChoice:
        triton = cfg.triton and kernels.enabled(device)
        fused = triton and device.type == "cuda" and fusable(mc)
        gpu_invariant = cfg.batch_invariant and device.type != "cpu"
        if gpu_invariant and not fused:
            raise ValueError(
                "batch_invariant on a GPU needs the Triton kernels (triton on, CUDA, power-of-two head_dim and KV "
                "heads): the torch ops path picks reduction kernels by shape"
            )
        return cls(
            invariant_rows=cfg.max_num_seqs if cfg.batch_invariant and not gpu_invariant else 0,
            invariant_gemm=gpu_invariant,
            fused=fused,
            triton_kv_quant=triton,
            pdl=fused and cfg.pdl and kernels.pdl_supported(device),
            gemv=_gemv_plan(cfg) if fused and not gpu_invariant else {},
            int8_decode=cfg.int8_decode_kernel,
            dense_decode=cfg.dense_decode_kernel,
            dense_prefill=cfg.dense_prefill_kernel,
            fa3_num_splits=cfg.fa3_num_splits,
            decode_config=cfg.decode_kernel_overrides(),
        )

    # ---- model ops ---------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, proj: str) -> torch.Tensor:
        """x [T, in] -> [T, out]: F.linear, or the Triton GEMV of `proj`'s plan for a few rows; with
        `invariant_rows`, F.linear over zero-padded blocks of exactly that many rows (see `invariant_linear`); with
        `invariant_gemm`, the Triton GEMM whose rows never depend on each other."""
        if self.invariant_gemm:
            from pdserve.engine.kernels.invariant_matmul import invariant_matmul

            return invariant_matmul(x, w, b)
        if self.invariant_rows:
            return invariant_linear(x, w, b, self.invariant_rows)
        cfg = self.gemv.get(proj)
        if cfg is not None and x.shape[0] <= GEMV_MAX_ROWS:
            from pdserve.engine.kernels.gemv import gemv

            return gemv(x, w, b, pdl=self.pdl, **cfg)
        return F.linear(x, w, b)

    def rmsnorm(self, x: torch.Tensor, norm) -> torch.Tensor:
        """norm(x) for an RMSNorm module `norm`."""
        if self.fused:
            from pdserve.engine.kernels.rmsnorm import rmsnorm

            return rmsnorm(x, norm.weight, norm.eps, pdl=self.pdl)
        return norm(x)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, norm) -> torch.Tensor:
        """residual += x (in place); returns norm(residual)."""
        if self.fused:
            from pdserve.engine.kernels.rmsnorm import rmsnorm

            return rmsnorm(x, norm.weight, norm.eps, residual, pdl=self.pdl)
        residual.add_(x)
        return norm(residual)

    def swiglu_linear(self, gate_up: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """gate_up [T, 2I] (gate | up) -> linear(silu(gate) * up) [T, out]; with a Triton GEMV for `down` and
        few rows, SwiGLU runs inside it (one kernel less)."""
        if not self.fused:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.linear(F.silu(gate) * up, w, b, "down")
        cfg = self.gemv.get("down")
        if cfg is not None and gate_up.shape[0] <= GEMV_MAX_ROWS:
            from pdserve.engine.kernels.gemv import gemv

            return gemv(gate_up, w, b, act="silu_mul", pdl=self.pdl, **cfg)
        from pdserve.engine.kernels.silu_mul import silu_mul

        return self.linear(silu_mul(gate_up, pdl=self.pdl), w, b, "down")

    def rope_and_store(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, rotary, cache
    ) -> torch.Tensor:
        """Rotate q [T, H, D] and k [T, KVH, D] at `meta.positions`, store k/v at `meta.slot_mapping` of the pool;
        returns the rotated q (the fused kernel rotates q in place)."""
        if self.fused:
            from pdserve.engine.kernels.rope_kv_write import rope_kv_write

            rope_kv_write(
                meta.positions,
                q,
                k,
                v,
                rotary.cos,
                rotary.sin,
                meta.slot_mapping,
                cache.layer_pool(layer),
                pdl=self.pdl,
            )
            return q
        q, k = rotary(meta.positions, q, k)
        cache.write(layer, meta.slot_mapping, k, v)
        return q

    # ---- quantized KV (the KV pool's quantizer) ---------------------------------------------------------
    def _triton_quant(self, t: torch.Tensor, group_size: int) -> bool:
        if not self.triton_kv_quant or not kernels.enabled(t.device):
            return False
        from pdserve.engine.kernels import kv_quant

        return kv_quant.supported(t.shape[-1], group_size)

    def quantize(
        self, x: torch.Tensor, group_size: int, asymmetric: bool, dtype: torch.dtype = torch.int8
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """pdserve.kv.quant.quantize (int8 or float8_e4m3fn), through Triton where chosen and the shape allows."""
        if (
            self._triton_quant(x, group_size)
            and x.shape[-1] % group_size == 0
            and (dtype == torch.int8 or (dtype == quant.FP8 and not asymmetric))
        ):
            from pdserve.engine.kernels import kv_quant

            return kv_quant.quantize(x, group_size, asymmetric, fp8=dtype == quant.FP8)
        return quant.quantize(x, group_size, asymmetric, dtype)

    def dequantize(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        group_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """pdserve.kv.quant.dequantize (int8 or float8_e4m3fn), through Triton where chosen and the shape allows."""
        if (
            self._triton_quant(q, group_size)
            and q.dtype in (torch.int8, quant.FP8)
            and (zeros is None or q.dtype == torch.int8)
            and scales.dtype == torch.float16
            and scales.shape == (*q.shape[:-1], q.shape[-1] // group_size)
            and (zeros is None or zeros.dtype == torch.float16)
        ):
            from pdserve.engine.kernels import kv_quant

            return kv_quant.dequantize(q, scales, zeros, group_size, dtype)
        return quant.dequantize(q, scales, zeros, group_size, dtype)


def invariant_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int) -> torch.Tensor:
    """F.linear of x [T, in] computed in zero-padded blocks of exactly `rows` rows: a GEMM's kernel (and so the
    summation order of each output) depends on its shapes, so with one shape every row's result depends only on
    that row, never on how many rows share the call (batch mates, chunking). Costs nothing when T is a multiple of
    `rows`; a lone decode row pays for a block of `rows` (why `batch_invariant` is off by default)."""
    t = x.shape[0]
    pad = -t % rows
    xp = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x
    out = torch.cat([F.linear(xp[i : i + rows], w, b) for i in range(0, t + pad, rows)]) if t else F.linear(x, w, b)
    return out[:t]


def _gemv_plan(cfg: EngineConfig) -> dict[str, dict | None]:
    """EngineConfig.gemv_plan -> projection -> Triton GEMV config (None: cuBLAS)."""
    from pdserve.engine.kernels.gemv import DEFAULT_CONFIG, DEFAULT_PLAN

    plan = cfg.gemv_projections()
    if plan == "default":
        return {p: None if (c := DEFAULT_PLAN[p]) is None else dict(c) for p in GEMV_PROJECTIONS}
    if plan == "cublas":
        return {p: None for p in GEMV_PROJECTIONS}
    if plan == "triton":
        return {p: dict(DEFAULT_CONFIG) for p in GEMV_PROJECTIONS}
    assert isinstance(plan, dict)  # gemv_projections returns one of the three names above or a dict
    return {p: plan.get(p) for p in GEMV_PROJECTIONS}
