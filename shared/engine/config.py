"""Engine configuration and its resolution (device, dtype) against the machine and the checkpoint."""
from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

CPU_MAX_AUTO_PAGES = 8192


@dataclass
class EngineConfig:
    model_dir: str
    dtype: str = "auto"                # auto: float32 on CPU, checkpoint dtype on GPU
    device: str = "auto"               # auto: cuda if available else cpu
    page_size: int = 16                # tokens per KV page
    chunk_size: int = 2048             # prefill tokens per step (across sequences)
    num_pages: int = 0                 # 0: auto (see engine._auto_num_pages)
    max_num_seqs: int = 64             # largest decode batch / sequences admitted at once
    kv_dtype: str = "auto"             # auto: model dtype | int8
    kv_group_size: int = 64            # int8 group size along head_dim (clamped to head_dim)
    kv_asymmetric: bool = False        # int8 with zero points
    attention_backend: str = "auto"    # auto | fa3 | sdpa
    int8_decode_kernel: str = "triton"  # FA3 + int8 pool, decode: triton (reads int8 pages) | dequant (+ FA3)
    cuda_graphs: bool = True           # decode through CUDA graphs (CUDA + FA3 + fused model path)
    cuda_graph_max_context: int = 8192  # page-table width of the graphs; longer sequences decode eagerly
    gpu_memory_utilization: float = 0.85  # GPU auto pages: fraction of free memory for the KV pool
    seed: int = 0                      # engine RNG: seeds generators of requests without a seed

    def validate(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {self.page_size}")
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {self.chunk_size}")
        if self.num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {self.num_pages}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.kv_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'int8', got {self.kv_dtype!r}")
        if self.kv_group_size <= 0:
            raise ValueError(f"kv_group_size must be > 0, got {self.kv_group_size}")
        if self.int8_decode_kernel not in ("triton", "dequant"):
            raise ValueError(f"int8_decode_kernel must be triton|dequant, got {self.int8_decode_kernel!r}")
        if self.cuda_graph_max_context <= 0:
            raise ValueError(f"cuda_graph_max_context must be > 0, got {self.cuda_graph_max_context}")
        if self.attention_backend not in ("auto", "fa3", "sdpa"):
            raise ValueError(f"attention_backend must be auto|fa3|sdpa, got {self.attention_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (float32, bfloat16, float16 or auto)") from None


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """`auto`: float32 on CPU; on GPU the checkpoint's dtype (float32 checkpoints stay float32)."""
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
