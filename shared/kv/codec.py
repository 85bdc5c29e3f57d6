"""PagePayload <-> checksummed KVPage messages (one page on the wire), and the page checks every KV path shares.

A page is a `pdserve.v1.KVPage` message. Bytes are C-order, little-endian: data [2, layer_count, num_tokens,
kv_heads, head_dim] of the layout's dtype, scales / zero_points [2, layer_count, num_tokens, kv_heads,
head_dim // group_size] float16. The checksum is zlib.crc32 over a canonical header (every field of the message
except the byte fields and the checksum, plus the byte lengths) followed by data, scales and zero_points.

`request_id` names the request the page belongs to. (Batches of pages travel as `pdserve.kv.transfer.wire`
messages and prompt-cache values as `pdserve.cache.value`; both check values with `check_values`.)

Errors: a payload or layout that does not fit (a caller's mistake) raises `InvalidRequest`; `decode_page` never
returns a tensor it could not fully verify: any damaged byte or disagreement with what the reader expects
raises `CorruptPage`, and so do values attention cannot use: NaN or infinite scales / zero points, NaN or infinite
dense (bf16/fp16/fp32) data and fp8 e4m3 NaN encodings (a checksum only proves the sender meant them; in the pool
they would poison attention and every token after). `check_values` is the same check for a batch of pages on any
device (the KV receivers call it before a page reaches the pool).
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from dataclasses import dataclass

import torch

from pdserve.errors import CorruptPage, InvalidRequest
from pdserve.kv.dtypes import DTYPES, QUANTIZED, by_wire
from pdserve.kv.payload import PagePayload
from pdserve.v1 import kv_pb2

FORMAT_VERSION = 1

if sys.byteorder != "little":  # the wire is little-endian and we copy native bytes
    raise ImportError("pdserve.kv.codec requires a little-endian host")


@dataclass(frozen=True)
class KVLayoutSpec:
    """How a KVPage's bytes are laid out (mirrors pdserve.v1.KVLayout)."""

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


def checksum(msg: kv_pb2.KVPage) -> int:
    """CRC32 over the canonical header and the three byte fields (the msg.checksum field is ignored)."""
    header = b"".join(
        [
            b"PDKV",
            pack_str(msg.request_id),
            struct.pack("<QIIII", msg.seq_no, msg.page_index, msg.layer_start, msg.layer_count, msg.num_tokens),
            pack_layout(msg.layout),
            pack_str(msg.model_fingerprint),
            struct.pack("<QQQ", len(msg.data), len(msg.scales), len(msg.zero_points)),
        ]
    )
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


def _check_ranges(
    layout: KVLayoutSpec, layer_start: int, layer_count: int, num_tokens: int, error: type[InvalidRequest]
) -> None:
    if not 1 <= num_tokens <= layout.page_size:
        raise error(f"num_tokens {num_tokens} outside [1, page_size {layout.page_size}]")
    if layer_count < 1 or layer_start < 0 or layer_start + layer_count > layout.num_layers:
        raise error(
            f"layer range [{layer_start}, {layer_start + layer_count}) outside model's {layout.num_layers} layers"
        )


def encode_page(
    payload: PagePayload, *, request_id: str, seq_no: int, layout: KVLayoutSpec, fingerprint: str
) -> kv_pb2.KVPage:
    """Serialize one page; raises InvalidRequest if the payload does not match `layout`."""
    layout.validate()
    layer_count = payload.data.shape[1] if payload.data.dim() == 5 else 0
    _check_ranges(layout, payload.layer_start, layer_count, payload.num_tokens, InvalidRequest)
    data_shape, scales_shape = _shapes(layout, layer_count, payload.num_tokens)
    if tuple(payload.data.shape) != data_shape or payload.data.dtype != layout.torch_dtype:
        raise InvalidRequest(
            f"payload data {tuple(payload.data.shape)} {payload.data.dtype} does not match "
            f"layout {data_shape} {layout.torch_dtype}"
        )
    scales = zeros = b""
    if layout.quantized:
        if payload.group_size != layout.group_size:
            raise InvalidRequest(f"payload group_size {payload.group_size} != layout {layout.group_size}")
        if (
            payload.scales is None
            or tuple(payload.scales.shape) != scales_shape
            or payload.scales.dtype != torch.float16
        ):
            raise InvalidRequest(f"payload scales do not match layout {scales_shape} float16")
        if layout.asymmetric != (payload.zeros is not None):
            raise InvalidRequest(f"payload zeros presence does not match layout asymmetric={layout.asymmetric}")
        if payload.zeros is not None:
            if tuple(payload.zeros.shape) != scales_shape or payload.zeros.dtype != torch.float16:
                raise InvalidRequest(f"payload zeros do not match layout {scales_shape} float16")
            zeros = _to_bytes(payload.zeros)
        scales = _to_bytes(payload.scales)
    elif payload.group_size != 0 or payload.scales is not None or payload.zeros is not None:
        raise InvalidRequest("quantized payload for an unquantized layout")
    msg = kv_pb2.KVPage(
        request_id=request_id,
        seq_no=seq_no,
        page_index=payload.page_index,
        layer_start=payload.layer_start,
        layer_count=layer_count,
        num_tokens=payload.num_tokens,
        layout=layout.to_proto(),
        model_fingerprint=fingerprint,
        data=_to_bytes(payload.data),
        scales=scales,
        zero_points=zeros,
    )
    msg.checksum = checksum(msg)
    return msg


def decode_page(
    msg: kv_pb2.KVPage, *, expected_layout: KVLayoutSpec, expected_fingerprint: str, expected_request_id: str
) -> PagePayload:
    """Verify and deserialize one page (CPU tensors); raises CorruptPage(reason) on any mismatch."""
    if not msg.HasField("layout"):
        raise CorruptPage("page has no layout")
    try:
        layout = KVLayoutSpec.from_proto(msg.layout)
        layout.validate()
    except InvalidRequest as e:  # an unusable layout in a page makes the page unusable
        raise CorruptPage(f"page layout: {e}") from None
    if layout != expected_layout:
        raise CorruptPage(f"layout mismatch: got {layout}, expected {expected_layout}")
    if msg.model_fingerprint != expected_fingerprint:
        raise CorruptPage(
            f"model fingerprint mismatch: got {msg.model_fingerprint!r}, expected {expected_fingerprint!r}"
        )
    if msg.request_id != expected_request_id:
        raise CorruptPage(f"request id mismatch: got {msg.request_id!r}, expected {expected_request_id!r}")
    _check_ranges(layout, msg.layer_start, msg.layer_count, msg.num_tokens, CorruptPage)
    data_shape, scales_shape = _shapes(layout, msg.layer_count, msg.num_tokens)
    want = {
        "data": math.prod(data_shape) * DTYPES[layout.dtype].itemsize,
        "scales": math.prod(scales_shape) * 2 if layout.quantized else 0,
        "zero_points": math.prod(scales_shape) * 2 if layout.quantized and layout.asymmetric else 0,
    }
    for field, n in want.items():
        got = len(getattr(msg, field))
        if got != n:
            raise CorruptPage(f"{field} has {got} bytes, layout and shape require {n}")
    if checksum(msg) != msg.checksum:
        raise CorruptPage(f"checksum mismatch (page {msg.page_index}, seq_no {msg.seq_no})")
    data = _from_bytes(msg.data, layout.torch_dtype, data_shape)
    scales = _from_bytes(msg.scales, torch.float16, scales_shape) if layout.quantized else None
    zeros = _from_bytes(msg.zero_points, torch.float16, scales_shape) if want["zero_points"] else None
    check_values(data, scales, zeros)
    return PagePayload(
        page_index=msg.page_index,
        num_tokens=msg.num_tokens,
        layer_start=msg.layer_start,
        data=data,
        scales=scales,
        zeros=zeros,
        group_size=layout.group_size,
    )


def _usable(t: torch.Tensor) -> torch.Tensor:
    """0-dim bool: every value of `t` is one attention can use (float: finite; fp8 e4m3, which has no infinities:
    not the NaN bytes 0x7F / 0xFF; integers: always)."""
    if t.dtype == torch.float8_e4m3fn:
        return ((t.view(torch.uint8) & 0x7F) != 0x7F).all()
    if t.dtype.is_floating_point:
        return torch.isfinite(t).all()
    return torch.ones((), dtype=torch.bool, device=t.device)


def _all_usable(tensors: list[torch.Tensor], complete: bool = False) -> bool:
    """Whether every tensor passes `_usable`: one reduction each and one host sync in all; on CUDA on a side stream
    (waiting here never waits for the engine stream's later steps). `complete`: no stream has work pending on the
    tensors, so the side stream need not wait for the work queued on the current one (an engine step in flight)."""
    if not tensors:
        return True
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
