"""PagePayload <-> pdserve.v1.KVPage wire codec with a CRC32 checksum and strict parsing.

Bytes are C-order, little-endian: data [2, layer_count, num_tokens, kv_heads, head_dim] of the layout's
dtype, scales / zero_points [2, layer_count, num_tokens, kv_heads, head_dim // group_size] float16.
The checksum is zlib.crc32 over a canonical header (every field of the message except the byte fields
and the checksum, plus the byte lengths) followed by data, scales and zero_points.

decode_page never returns a tensor it could not fully verify: any mismatch raises KVPageError.
"""
from __future__ import annotations

import math
import struct
import sys
import zlib
from dataclasses import dataclass

import torch

from pdserve.kv.payload import PagePayload
from pdserve.v1 import kv_pb2

FORMAT_VERSION = 1

_DTYPES: dict[str, tuple[int, torch.dtype]] = {
    "int8": (kv_pb2.KV_DTYPE_INT8, torch.int8),
    "float32": (kv_pb2.KV_DTYPE_FLOAT32, torch.float32),
    "bfloat16": (kv_pb2.KV_DTYPE_BFLOAT16, torch.bfloat16),
    "float16": (kv_pb2.KV_DTYPE_FLOAT16, torch.float16),
}
_DTYPE_NAMES = {enum: name for name, (enum, _) in _DTYPES.items()}

if sys.byteorder != "little":  # the wire is little-endian and we copy native bytes
    raise ImportError("pdserve.kv.codec requires a little-endian host")


class KVPageError(ValueError):
    """A KV page that must not be used: corrupt, truncated, or for another model / layout / request."""


@dataclass(frozen=True)
class KVLayoutSpec:
    """How a KVPage's bytes are laid out (mirrors pdserve.v1.KVLayout)."""
    dtype: str            # "int8" | "float32" | "bfloat16" | "float16"
    page_size: int
    num_layers: int       # of the model
    num_kv_heads: int
    head_dim: int
    group_size: int = 0   # 0 when unquantized
    asymmetric: bool = False
    format_version: int = FORMAT_VERSION

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][1]

    @property
    def quantized(self) -> bool:
        return self.dtype == "int8"

    def validate(self) -> None:
        """Raise KVPageError if the layout is not self-consistent or not supported."""
        if self.format_version != FORMAT_VERSION:
            raise KVPageError(f"unsupported KV format_version {self.format_version} (want {FORMAT_VERSION})")
        if self.dtype not in _DTYPES:
            raise KVPageError(f"unknown KV dtype {self.dtype!r}")
        if min(self.page_size, self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise KVPageError(f"layout has a non-positive dimension: {self}")
        if self.quantized:
            if self.group_size <= 0 or self.head_dim % self.group_size != 0:
                raise KVPageError(f"group_size {self.group_size} does not divide head_dim {self.head_dim}")
        elif self.group_size != 0 or self.asymmetric:
            raise KVPageError(f"unquantized layout ({self.dtype}) must have group_size 0 and asymmetric false")

    def to_proto(self) -> kv_pb2.KVLayout:
        return kv_pb2.KVLayout(format_version=self.format_version, dtype=_DTYPES[self.dtype][0],
                               page_size=self.page_size, num_layers=self.num_layers,
                               num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                               group_size=self.group_size, asymmetric=self.asymmetric)

    @classmethod
    def from_proto(cls, msg: kv_pb2.KVLayout) -> KVLayoutSpec:
        if msg.dtype not in _DTYPE_NAMES:
            raise KVPageError(f"unknown or unspecified KV dtype enum {msg.dtype}")
        return cls(dtype=_DTYPE_NAMES[msg.dtype], page_size=msg.page_size, num_layers=msg.num_layers,
                   num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, group_size=msg.group_size,
                   asymmetric=msg.asymmetric, format_version=msg.format_version)


def _str_field(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def checksum(msg: kv_pb2.KVPage) -> int:
    """CRC32 over the canonical header and the three byte fields (the msg.checksum field is ignored)."""
    lay = msg.layout
    header = b"".join([
        b"PDKV",
        _str_field(msg.request_id),
        struct.pack("<QIIII", msg.seq_no, msg.page_index, msg.layer_start, msg.layer_count, msg.num_tokens),
        struct.pack("<IIIIIIIB", lay.format_version, lay.dtype, lay.page_size, lay.num_layers, lay.num_kv_heads,
                    lay.head_dim, lay.group_size, int(lay.asymmetric)),
        _str_field(msg.model_fingerprint),
        struct.pack("<QQQ", len(msg.data), len(msg.scales), len(msg.zero_points)),
    ])
    crc = zlib.crc32(header)
    for b in (msg.data, msg.scales, msg.zero_points):
        crc = zlib.crc32(b, crc)
    return crc


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(b: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=dtype).reshape(shape)  # own copy: no aliasing of msg bytes


def _shapes(layout: KVLayoutSpec, layer_count: int, num_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    data = (2, layer_count, num_tokens, layout.num_kv_heads, layout.head_dim)
    scales = (2, layer_count, num_tokens, layout.num_kv_heads, layout.head_dim // max(layout.group_size, 1))
    return data, scales


def _check_ranges(layout: KVLayoutSpec, layer_start: int, layer_count: int, num_tokens: int) -> None:
    if not 1 <= num_tokens <= layout.page_size:
        raise KVPageError(f"num_tokens {num_tokens} outside [1, page_size {layout.page_size}]")
    if layer_count < 1 or layer_start < 0 or layer_start + layer_count > layout.num_layers:
        raise KVPageError(f"layer range [{layer_start}, {layer_start + layer_count}) outside model's "
                          f"{layout.num_layers} layers")


def encode_page(payload: PagePayload, *, request_id: str, seq_no: int, layout: KVLayoutSpec,
                fingerprint: str) -> kv_pb2.KVPage:
    """Serialize one page; raises KVPageError if the payload does not match `layout`."""
    layout.validate()
    layer_count = payload.data.shape[1] if payload.data.dim() == 5 else 0
    _check_ranges(layout, payload.layer_start, layer_count, payload.num_tokens)
    data_shape, scales_shape = _shapes(layout, layer_count, payload.num_tokens)
    if tuple(payload.data.shape) != data_shape or payload.data.dtype != layout.torch_dtype:
        raise KVPageError(f"payload data {tuple(payload.data.shape)} {payload.data.dtype} does not match layout "
                          f"{data_shape} {layout.torch_dtype}")
    scales = zeros = b""
    if layout.quantized:
        if payload.group_size != layout.group_size:
            raise KVPageError(f"payload group_size {payload.group_size} != layout {layout.group_size}")
        if payload.scales is None or tuple(payload.scales.shape) != scales_shape \
                or payload.scales.dtype != torch.float16:
            raise KVPageError(f"payload scales do not match layout {scales_shape} float16")
        if layout.asymmetric != (payload.zeros is not None):
            raise KVPageError(f"payload zeros presence does not match layout asymmetric={layout.asymmetric}")
        if payload.zeros is not None:
            if tuple(payload.zeros.shape) != scales_shape or payload.zeros.dtype != torch.float16:
                raise KVPageError(f"payload zeros do not match layout {scales_shape} float16")
            zeros = _to_bytes(payload.zeros)
        scales = _to_bytes(payload.scales)
    elif payload.group_size != 0 or payload.scales is not None or payload.zeros is not None:
        raise KVPageError("quantized payload for an unquantized layout")
    msg = kv_pb2.KVPage(request_id=request_id, seq_no=seq_no, page_index=payload.page_index,
                        layer_start=payload.layer_start, layer_count=layer_count, num_tokens=payload.num_tokens,
                        layout=layout.to_proto(), model_fingerprint=fingerprint, data=_to_bytes(payload.data),
                        scales=scales, zero_points=zeros)
    msg.checksum = checksum(msg)
    return msg


def decode_page(msg: kv_pb2.KVPage, *, expected_layout: KVLayoutSpec, expected_fingerprint: str,
                expected_request_id: str) -> PagePayload:
    """Verify and deserialize one page (CPU tensors); raises KVPageError(reason) on any mismatch."""
    if not msg.HasField("layout"):
        raise KVPageError("page has no layout")
    if msg.layout.format_version != FORMAT_VERSION:
        raise KVPageError(f"unsupported KV format_version {msg.layout.format_version} (want {FORMAT_VERSION})")
    layout = KVLayoutSpec.from_proto(msg.layout)
    if layout != expected_layout:
        raise KVPageError(f"layout mismatch: got {layout}, expected {expected_layout}")
    layout.validate()
    if msg.model_fingerprint != expected_fingerprint:
        raise KVPageError(f"model fingerprint mismatch: got {msg.model_fingerprint!r}, "
                          f"expected {expected_fingerprint!r}")
    if msg.request_id != expected_request_id:
        raise KVPageError(f"request id mismatch: got {msg.request_id!r}, expected {expected_request_id!r}")
    _check_ranges(layout, msg.layer_start, msg.layer_count, msg.num_tokens)
    data_shape, scales_shape = _shapes(layout, msg.layer_count, msg.num_tokens)
    elem = torch.empty((), dtype=layout.torch_dtype).element_size()
    want = {"data": math.prod(data_shape) * elem,
            "scales": math.prod(scales_shape) * 2 if layout.quantized else 0,
            "zero_points": math.prod(scales_shape) * 2 if layout.quantized and layout.asymmetric else 0}
    for field, n in want.items():
        got = len(getattr(msg, field))
        if got != n:
            raise KVPageError(f"{field} has {got} bytes, layout and shape require {n}")
    if checksum(msg) != msg.checksum:
        raise KVPageError(f"checksum mismatch (page {msg.page_index}, seq_no {msg.seq_no})")
    data = _from_bytes(msg.data, layout.torch_dtype, data_shape)
    scales = _from_bytes(msg.scales, torch.float16, scales_shape) if layout.quantized else None
    zeros = _from_bytes(msg.zero_points, torch.float16, scales_shape) if want["zero_points"] else None
    return PagePayload(page_index=msg.page_index, num_tokens=msg.num_tokens, layer_start=msg.layer_start,
                       data=data, scales=scales, zeros=zeros, group_size=layout.group_size)
