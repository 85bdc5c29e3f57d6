"""The KV page layout every transfer path names (`KVLayoutSpec`, the wire's `pdserve.v1.KVLayout`), the canonical
header bytes that batch and prompt-cache checksums cover (`pack_layout`, `pack_str`), and the value checks every KV
path shares.

Pages travel as batches of whole pages (`pdserve.kv.transfer.page_format` lays out the bytes,
`pdserve.kv.transfer.wire` frames and checksums them) and prompt-cache values as `pdserve.cache.value`; both check
values with `check_values`.

Errors: a layout that does not fit (a caller's mistake) raises `InvalidRequest`; `check_values` raises `CorruptPage`
for values attention cannot use: NaN or infinite scales / zero points, NaN or infinite dense (bf16/fp16/fp32) data and
fp8 e4m3 NaN encodings (a checksum only proves the sender meant them; in the pool they would poison attention and
every token after), on any device (the KV receivers call it before a page reaches the pool).
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

import torch

from pdserve.errors import CorruptPage, InvalidRequest
from pdserve.kv.dtypes import DTYPES, QUANTIZED, by_wire
from pdserve.v1 import kv_pb2

FORMAT_VERSION = 1

if sys.byteorder != "little":  # the wire is little-endian and we copy native bytes
    raise ImportError("pdserve.kv.codec requires a little-endian host")


@dataclass(frozen=True)
class KVLayoutSpec:
    """How the bytes of a page are laid out (mirrors pdserve.v1.KVLayout)."""

    dtype: str  # a name of pdserve.kv.dtypes.DTYPES: "int8" | "fp8" | "float32" | "bfloat16" | "float16"
    page_size: int
    num_layers: int  # of the model
    num_kv_heads: int
    head_dim: int
    group_size: int = 0  # 0 when unquantized
    asymmetric: bool = False
    format_version: int = FORMAT_VERSION

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype].torch_dtype

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED  # int8 | fp8: values + per-group fp16 scales

    def validate(self) -> None:
        """Raise InvalidRequest if the layout is not self-consistent or not supported."""
        if self.format_version != FORMAT_VERSION:
            raise InvalidRequest(f"unsupported KV format_version {self.format_version} (want {FORMAT_VERSION})")
        if self.dtype not in DTYPES:
            raise InvalidRequest(f"unknown KV dtype {self.dtype!r}")
        if min(self.page_size, self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise InvalidRequest(f"layout has a non-positive dimension: {self}")
        if self.quantized:
            if self.group_size <= 0 or self.head_dim % self.group_size != 0:
                raise InvalidRequest(f"group_size {self.group_size} does not divide head_dim {self.head_dim}")
            if self.asymmetric and self.dtype != "int8":
                raise InvalidRequest(f"{self.dtype} KV is symmetric only (asymmetric must be false)")
        elif self.group_size != 0 or self.asymmetric:
            raise InvalidRequest(f"unquantized layout ({self.dtype}) must have group_size 0 and asymmetric false")

    def to_proto(self) -> kv_pb2.KVLayout:
        return kv_pb2.KVLayout(
            format_version=self.format_version,
            dtype=DTYPES[self.dtype].wire,
            page_size=self.page_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            group_size=self.group_size,
            asymmetric=self.asymmetric,
        )

    @classmethod
    def from_proto(cls, msg: kv_pb2.KVLayout) -> KVLayoutSpec:
        """Raises InvalidRequest for an unknown or unspecified dtype (call validate() for the rest)."""
        dt = by_wire(msg.dtype)
        if dt is None:
            raise InvalidRequest(f"unknown or unspecified KV dtype enum {msg.dtype}")
        return cls(
            dtype=dt.name,
            page_size=msg.page_size,
            num_layers=msg.num_layers,
            num_kv_heads=msg.num_kv_heads,
            head_dim=msg.head_dim,
            group_size=msg.group_size,
            asymmetric=msg.asymmetric,
            format_version=msg.format_version,
        )


def pack_str(s: str) -> bytes:
    """A string in canonical header bytes: little-endian u32 length, then its UTF-8."""
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def pack_layout(lay: kv_pb2.KVLayout) -> bytes:
    """A KVLayout in canonical header bytes (page and batch checksums cover it)."""
    return struct.pack(
        "<IIIIIIIB",
        lay.format_version,
        lay.dtype,
        lay.page_size,
        lay.num_layers,
        lay.num_kv_heads,
        lay.head_dim,
        lay.group_size,
        int(lay.asymmetric),
    )


def _usable(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool: every value of `t` is one attention can use (float: finite; fp8 e4m3, which has no infinities:
    not the NaN bytes 0x7F / 0xFF; integers: always)."""
    if t.dtype == torch.float8_e4m3fn:
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    if t.dtype.is_floating_point:
        return torch.isfinite(t).all()
    return torch.ones((), dtype=torch.bool, device=t.device)


# float dtype -> (the integer view of the same width, its exponent bits): a value is NaN or infinite iff all are set
_EXPONENT_BITS = {
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float8_e4m3fn: (torch.uint8, 0x7F),  # no infinities: 0x7F / 0xFF are its NaN encodings
}


def _usable_on_host(t: torch.Tensor) -> bool:
    """`_usable` for a CPU tensor, by its exponent bits in numpy: one vectorized pass with the GIL released, where
    torch's CPU reductions fan out to OpenMP threads (40x slower on a loaded 2-core host, on a KV receiver's path)."""
    bits = _EXPONENT_BITS.get(t.dtype)
    if bits is None:
        return bool(_usable(t))
    as_int, mask = bits
    view = t.view(as_int).numpy()  # same element size: any strides
    return not bool(((view & mask) == mask).any())


def unusable_bits(dtype: torch.dtype) -> tuple[int, int]:
    """(item size, mask) such that an element whose bits hold all of `mask` is one attention cannot use (NaN or
    infinity; fp8: its NaN encodings); mask 0: every value usable (integers). For checks without torch."""
    bits = _EXPONENT_BITS.get(dtype)
    if bits is None:
        return torch.empty((), dtype=dtype).element_size(), 0
    as_int, mask = bits
    return torch.empty((), dtype=as_int).element_size(), mask


def _all_usable(tensors: list[torch.Tensor], complete: bool = False) -> bool:
    """Whether every tensor passes `_usable`: one reduction each and one host sync in all; on CUDA on a side stream
    (waiting here never waits for the engine stream's later steps). `complete`: no stream has work pending on the
    tensors, so the side stream need not wait for the work queued on the current one (an engine step in flight)."""
    if not tensors:
        return True
    if tensors[0].device.type == "cpu":
        return all(_usable_on_host(t) for t in tensors)
    if tensors[0].device.type != "cuda":
        return all(bool(_usable(t)) for t in tensors)
    side = torch.cuda.Stream(device=tensors[0].device)
    if not complete:
        side.wait_stream(torch.cuda.current_stream(tensors[0].device))
    with torch.cuda.stream(side):
        return bool(torch.stack([_usable(t) for t in tensors]).all().item())


def check_scales(scales: torch.Tensor | None, zeros: torch.Tensor | None, *, complete: bool = False) -> None:
    """Raise CorruptPage unless every scale and zero point (float16, any shape, any device) is finite (`complete`:
    as for `check_values`)."""
    for name, t in (("scales", scales), ("zero points", zeros)):
        if t is not None and t.numel() and not _all_usable([t], complete):
            raise CorruptPage(f"KV page {name} contain NaN or infinity")


def check_values(
    data: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor | None, *, complete: bool = False
) -> None:
    """Raise CorruptPage unless attention can use the page(s): finite scales and zero points, no NaN / infinity in
    dense float data, no NaN encoding in fp8 data (int8 data: every value is a value). One pass and one sync when
    all is well; only a failure looks again to name the culprit. `complete` (CUDA): the tensors have no pending
    work on any stream (a receiver's synchronized copy), so the check does not wait behind the engine's step."""
    if _all_usable([t for t in (data, scales, zeros) if t is not None and t.numel()], complete):
        return
    check_scales(scales, zeros, complete=complete)
    if data.dtype == torch.float8_e4m3fn:
        raise CorruptPage("KV page data contain fp8 NaN encodings")
    raise CorruptPage("KV page data contain NaN or infinity")
