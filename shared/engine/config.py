"""Engine configuration and its resolution (device, dtype) against the machine and the checkpoint."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.config import opt
from pdserve.engine.tp.layout import MAX_TP_SIZE

if TYPE_CHECKING:
    import torch
# torch is imported where it is used: processes that only read engine settings (`pdserve up`, the router) stay
# without it (about 200 MB of RSS each)

CPU_KV_CACHE_BYTES = 128 << 20  # CPU, kv_cache_memory "auto": the pool is allocated up front; small suits a demo
# largest prefill graph bucket: past a few thousand tokens a step computes far longer than it launches
MAX_PREFILL_GRAPH_TOKENS = 8192


@dataclass
class EngineConfig:
    """What one engine is. Services fill it from their flags / environment (`pdserve.config`: each field is a
    setting of the same name, `--model` for model_dir; help texts below) and give some fields defaults of their
    own (`pdserve.server.service_config.engine_settings`)."""

    model_dir: str = field(metadata={"help": "HF model directory (config.json, *.safetensors, tokenizer files)"})
    dtype: str = opt("auto", "auto|float32|bfloat16|float16 (auto: float32 on CPU, checkpoint dtype on GPU)")
    device: str = opt("auto", "auto|cpu|cuda|cuda:N (auto: cuda if available)")
    page_size: int = opt(16, "tokens per KV page")
    chunk_size: int = opt(2048, "prefill tokens per step (across sequences)")
    # a step decodes every running sequence and prefills in the same forward (scheduler.py): the budget bounds
    # decode rows + prefill tokens, so a step's time (TPOT while prompts are prefilled) stays about that of
    # chunk_size tokens; decode rows are never dropped, prefill keeps at least a quarter of the budget. -1 is
    # resolved by the service that runs the engine (colocated: pdserve.decode.step_budget); elsewhere it is 0
    step_token_budget: int = opt(
        0,
        "tokens one step computes, decode rows + prefill tokens (0: --chunk-size; -1: auto, chosen from the "
        "engine's measured step costs where the service supports it); prefill gets the rest",
    )
    num_pages: int = opt(0, "KV pool pages (0 = sized by --kv-cache-memory); overrides --kv-cache-memory")
    kv_cache_memory: str = opt(
        "auto",
        "KV pool memory, reserved at start: a size such as 512MiB or 2GiB, or auto: on CPU 128MiB (capped at "
        "--max-num-seqs full-length sequences), on a GPU what --gpu-memory-utilization leaves after the weights "
        "and the activation peak measured at start",
    )
    max_num_seqs: int = opt(64, "largest decode batch / sequences admitted at once")
    kv_dtype: str = opt(
        "int8", "KV pool format: int8 | fp8 (e4m3fn, one fp16 scale per token and KV head) | auto (the model dtype)"
    )
    kv_group_size: int = opt(64, "int8 KV quantization group size along head_dim (clamped to head_dim)")
    kv_asymmetric: bool = opt(False, "int8 KV with zero points (scale + zero point) instead of symmetric")
    quantization: str = opt(
        "none",
        "none|fp8: fp8 quantizes a bf16/fp32 checkpoint's projections at load to e4m3 per output channel, with "
        "per-token activation scales at run time; FP8 checkpoints load as FP8 either way (docs/fp8.md)",
    )
    load_format: str = opt(
        "auto",
        "auto|dummy: dummy builds the model from config.json alone with random weights generated on the device "
        "(bf16, or e4m3 + scales in the layout of config.json's FP8 quantization_config; no safetensors read): "
        "benchmarks of model shapes without a checkpoint",
    )
    attention_backend: str = opt("auto", "auto|fa3|sdpa")
    # ---- GPU kernels (CPU always runs plain torch ops; see kernel_choice.py) ----
    triton: bool = opt(True, "CUDA: Triton kernels (fused model path, int8 KV); false: plain torch ops as on CPU")
    pdl: bool = opt(True, "launch Triton kernels as programmatic dependent launches where supported (sm90+)")
    gemv_plan: str = opt("default", "decode GEMVs (<= 4 rows): default|cublas|triton or JSON {projection: config|null}")
    int8_decode_kernel: str = opt("triton", "FA3 + int8 pool, decode: triton (reads int8 pages) | dequant (+ FA3)")
    dense_decode_kernel: str = opt("triton", "FA3 + dense pool, decode: triton (reads dense pages) | fa3")
    dense_prefill_kernel: str = opt("paged", "FA3 + dense pool, prefill: paged (FA3 reads pages) | gather (varlen)")
    fa3_num_splits: int = opt(4, "FA3 decode split count (0: FA3's heuristic)")
    decode_kernel_config: str = opt("", "JSON overrides of the Triton decode-attention kernel config (block_n, ...)")
    cuda_graphs: bool = opt(True, "decode through CUDA graphs (CUDA + FA3 + fused model path)")
    cuda_graph_max_context: int = opt(
        0, "context the decode CUDA graphs cover (0: the model's whole context); longer contexts run eagerly"
    )
    # steps the decode graphs do not take (prefill chunks, mixed steps) of at most this many tokens replay
    # piecewise graphs, attention eager between them (prefill_graphs.py): their launch no longer costs the host
    # ~10 kernel launches a layer
    prefill_graph_tokens: int = opt(
        -1,
        "steps with prefill rows of at most this many tokens run through piecewise CUDA graphs (buckets up to it; "
        "-1: auto, a whole step: the larger of --chunk-size and --step-token-budget, plus --max-num-seqs decode "
        "rows; 0: off; needs --cuda-graphs)",
    )
    # the KV pool takes this share less the weights and the activation peak measured at start (a forward of one
    # step's tokens and its logits, ModelRunner._auto_num_pages); what stays outside it holds the CUDA context,
    # library workspaces and the decode and prefill CUDA graphs
    gpu_memory_utilization: float = opt(
        0.9, "GPU: fraction of the device's total memory this instance may fill (weights, activations, KV pool)"
    )
    seed: int = opt(0, "engine RNG: seeds the generators of requests without a seed")
    # CPU: linear layers in fixed row blocks and prefill attention one query row at a time
    # (KernelChoice.invariant_rows, SdpaBackend); CUDA: a row-independent Triton GEMM and every attention row
    # through the Triton decode kernel with fixed splits (KernelChoice.invariant_gemm, RowwiseTritonBackend)
    batch_invariant: bool = opt(
        False,
        "a request's tokens independent of its batch mates, chunking and prompt-cache hits with quantized KV; "
        "slower (row-wise prefill attention, fixed GEMM row blocks or a row-independent Triton GEMM)",
    )
    # the next step of an unchanged batch starts on the device (its inputs are the previous step's tokens, still
    # there) before the host processes the previous step's tokens (LLMEngine.step). auto: on with the decode CUDA
    # graphs (the host's per-token work hides behind the GPU's next step), off elsewhere (on CPU a launch computes
    # at once, so chaining would only deliver each token a step later); on: wherever it can (CPU tests of the
    # bookkeeping); off: never
    overlap_decode: str = opt(
        "auto", "auto|on|off: greedy decode launches the next step of an unchanged batch before processing this one"
    )
    # tensor parallel (pdserve.engine.tp): the instance's process is rank 0 (scheduler, gRPC) and starts ranks
    # 1..N-1 as child processes, each on its device (cuda:<index + rank> on GPUs; gloo on CPU)
    tensor_parallel_size: int = opt(
        1,
        "processes (ranks) that split the model's heads, FFN and vocabulary; the model's attention heads must "
        "divide by it. Decode and colocated instances (prefill: 1 for now; the prompt cache is off at N > 1)",
    )

    def graph_step_tokens(self) -> int:
        """The largest step the prefill graphs cover: `prefill_graph_tokens`, or (auto) a full chunk or step budget
        beside a full decode batch (a colocated step's mixed rows), at most MAX_PREFILL_GRAPH_TOKENS."""
        if self.prefill_graph_tokens >= 0:
            return self.prefill_graph_tokens
        return min(MAX_PREFILL_GRAPH_TOKENS, max(self.chunk_size, self.step_token_budget) + self.max_num_seqs)

    def validate(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {self.chunk_size}")
        if self.step_token_budget < -1:
            raise ValueError(f"step_token_budget must be >= -1 (0: chunk_size, -1: auto), got {self.step_token_budget}")
        if self.num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {self.num_pages}")
        self.kv_cache_bytes()
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.kv_dtype not in ("auto", "int8", "fp8"):
            raise ValueError(f"kv_dtype must be 'auto', 'int8' or 'fp8', got {self.kv_dtype!r}")
        if self.quantization not in ("none", "fp8"):
            raise ValueError(f"quantization must be 'none' or 'fp8', got {self.quantization!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.kv_group_size <= 0:
            raise ValueError(f"kv_group_size must be > 0, got {self.kv_group_size}")
        if self.int8_decode_kernel not in ("triton", "dequant"):
            raise ValueError(f"int8_decode_kernel must be triton|dequant, got {self.int8_decode_kernel!r}")
        if self.dense_decode_kernel not in ("triton", "fa3"):
            raise ValueError(f"dense_decode_kernel must be triton|fa3, got {self.dense_decode_kernel!r}")
        if self.dense_prefill_kernel not in ("paged", "gather"):
            raise ValueError(f"dense_prefill_kernel must be paged|gather, got {self.dense_prefill_kernel!r}")
        if self.fa3_num_splits < 0:
            raise ValueError(f"fa3_num_splits must be >= 0, got {self.fa3_num_splits}")
        self.gemv_projections()
        self.decode_kernel_overrides()
        if not -1 <= self.prefill_graph_tokens <= MAX_PREFILL_GRAPH_TOKENS:
            raise ValueError(
                f"prefill_graph_tokens must be -1..{MAX_PREFILL_GRAPH_TOKENS} (-1: auto, 0: off), got "
                f"{self.prefill_graph_tokens}"
            )
        if self.cuda_graph_max_context < 0:
            raise ValueError(
                f"cuda_graph_max_context must be >= 0 (0: whole context), got {self.cuda_graph_max_context}"
            )
        if self.attention_backend not in ("auto", "fa3", "sdpa"):
            raise ValueError(f"attention_backend must be auto|fa3|sdpa, got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.overlap_decode not in ("auto", "on", "off"):
            raise ValueError(f"overlap_decode must be auto|on|off, got {self.overlap_decode!r}")
        if not 1 <= self.tensor_parallel_size <= MAX_TP_SIZE:
            raise ValueError(f"tensor_parallel_size must be in 1..{MAX_TP_SIZE}, got {self.tensor_parallel_size}")

    def kv_cache_bytes(self) -> int | None:
        """`kv_cache_memory` in bytes (None: auto)."""
        return None if self.kv_cache_memory.strip().lower() == "auto" else parse_size(self.kv_cache_memory)

    def gemv_projections(self) -> dict[str, dict | None] | str:
        """`gemv_plan` parsed: "default" | "cublas" | "triton", or a dict projection -> Triton GEMV config | None
        (None: cuBLAS) over the projections qkv, o, gate_up, down."""
        if self.gemv_plan in ("default", "cublas", "triton"):
            return self.gemv_plan
        plan = _json_object("gemv_plan", self.gemv_plan)
        unknown = set(plan) - set(GEMV_PROJECTIONS)
        if unknown or any(v is not None and not isinstance(v, dict) for v in plan.values()):
            raise ValueError(
                f"gemv_plan: want default|cublas|triton or a JSON object over {GEMV_PROJECTIONS} "
                f"with a config object or null each, got {self.gemv_plan!r}"
            )
        return plan

    def decode_kernel_overrides(self) -> dict:
        """`decode_kernel_config` parsed ({} when empty)."""
        return _json_object("decode_kernel_config", self.decode_kernel_config) if self.decode_kernel_config else {}


GEMV_PROJECTIONS = ("qkv", "o", "gate_up", "down")  # the model's decode GEMVs


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt])(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes of a size such as 512MiB, 2GiB, 1.5G or 64m (binary units: K = 1024); a unit is required."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"kv_cache_memory wants auto or a size with a unit such as 512MiB or 2GiB, got {text!r}")
    size = int(float(m.group(1)) * 1024 ** ("kmgt".index(m.group(2).lower()) + 1))
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be > 0, got {text!r}")
    return size


def _json_object(name: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    return value


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r} (auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} requested but only {torch.cuda.device_count()} CUDA devices are visible")
        if dev.index is None:  # always an indexed device: it is set as each engine thread's current device
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


CUDA_CONTEXT_BYTES = 1 << 30  # what the CUDA context and libraries hold outside torch's allocator (estimate)


def gpu_kv_pool_bytes(total: int, free: int, process_bytes: int, utilization: float, activation_bytes: int = 0) -> int:
    """Bytes the KV pool may take on a GPU of `total` bytes with `free` bytes free now, when this process already
    holds `process_bytes` (weights, buffers, its CUDA context: read after the caching allocator released its unused
    blocks, which would otherwise count as held and as not free) and a step's activations need up to
    `activation_bytes` more at their peak: its share is `utilization` × total, counted from the whole device, so
    instances sharing a GPU each size from their own fraction (two at 0.45 fit together); never more than what is
    free now less the activations and a margin of one context. May be <= 0 (no room)."""
    share = utilization * total - process_bytes - activation_bytes
    return int(min(share, free - activation_bytes - CUDA_CONTEXT_BYTES))


def parse_dtype(name: str) -> torch.dtype:
    from pdserve.kv.dtypes import MODEL_DTYPES as _DTYPES  # lower-case name or alias -> torch dtype

    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (float32, bfloat16, float16 or auto)") from None


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto`: float32 on CPU; on GPU the checkpoint's dtype (float32 checkpoints stay float32)."""
    import torch

    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype:
        try:
            return parse_dtype(checkpoint_dtype)
        except ValueError:
            pass
    return torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16' (the names the KV wire layout uses)."""
    return str(dtype).removeprefix("torch.")
