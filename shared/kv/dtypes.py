"""The one dtype table: a dtype's name <-> torch dtype <-> KV wire enum (`pdserve.v1.KVDType`).

Names are what configs, the CLI and `KVLayoutSpec.dtype` use ("int8", "fp8", "float32", "bfloat16", "float16");
the aliases are extra spellings accepted for the model dtype ("bf16", "half", ...). The quantized KV dtypes
(`QUANTIZED`) store values plus per-group float16 scales (`pdserve.kv.quant`): "int8" (optionally with zero
points) and "fp8" (float8 e4m3fn, symmetric). Imports only torch and the
generated stubs, so both `pdserve.kv` and `pdserve.engine` use it without import cycles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.v1 import kv_pb2


@dataclass(frozen=True)
class DType:
    """One storable dtype: how torch holds it and how the KV wire names it."""

    name: str
    torch_dtype: torch.dtype
    wire: kv_pb2.KVDType  # pdserve.v1.KVDType enum value
    dense: bool  # a model (activation / unquantized KV) dtype; int8 and fp8 are quantized KV dtypes

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.torch_dtype.itemsize


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("int8", torch.int8, kv_pb2.KV_DTYPE_INT8, dense=False),
        DType("fp8", torch.float8_e4m3fn, kv_pb2.KV_DTYPE_FP8_E4M3, dense=False),
        DType("float32", torch.float32, kv_pb2.KV_DTYPE_FLOAT32, dense=True),
        DType("bfloat16", torch.bfloat16, kv_pb2.KV_DTYPE_BFLOAT16, dense=True),
        DType("float16", torch.float16, kv_pb2.KV_DTYPE_FLOAT16, dense=True),
    )
}
ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
QUANTIZED: tuple[str, ...] = tuple(name for name, d in DTYPES.items() if not d.dense)  # ("int8", "fp8")
_BY_WIRE: dict[int, DType] = {d.wire: d for d in DTYPES.values()}

# Model dtypes by lower-case name or alias -> torch dtype (what `EngineConfig.dtype` accepts besides "auto").
MODEL_DTYPES: dict[str, torch.dtype] = {name: d.torch_dtype for name, d in DTYPES.items() if d.dense} | {
    alias: DTYPES[name].torch_dtype for alias, name in ALIASES.items()
}


def by_wire(enum: int) -> DType | None:
    """The dtype of a `KVDType` enum value; None for UNSPECIFIED or an unknown value."""
    return _BY_WIRE.get(enum)
