"""One cached KV page as one self-contained binary value (one atomic Redis value per page).

Layout (little-endian), version 1:
    header  96 bytes: magic "PDKC", format version u16, dtype u8, flags u8 (bit 0: asymmetric),
            page_size, num_layers, num_kv_heads, head_dim, group_size, num_tokens, page_index (u32 each),
            reserved u32 (0), chain hash (32 bytes: the page's key digest), len(data), len(scales),
            len(zeros) (u64 each)
    data    [2, num_layers, num_tokens, kv_heads, head_dim] int8 or the dense dtype (K=0, V=1)
    scales  [2, num_layers, num_tokens, kv_heads, head_dim // group_size] float16 (int8 only)
    zeros   same as scales (asymmetric int8 only)
    crc32   u32 (zlib) over everything before it

`decode_value` parses strictly: every field is checked against what the caller expects (layout, chain hash,
page index, full page, all layers) and every length against the layout before the checksum; any mismatch
raises CacheValueError and the caller treats the page as a miss. No pickle anywhere.
"""
from __future__ import annotations

import math
import struct
import zlib

import torch

from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload

MAGIC = b"PDKC"
VERSION = 1
_HEADER = struct.Struct("<4sHBBIIIIIIII32sQQQ")  # 96 bytes: data starts 8-byte aligned
_CRC = struct.Struct("<I")
_DTYPE_CODES = {"int8": 1, "float32": 2, "bfloat16": 3, "float16": 4}
_DTYPES = {"int8": torch.int8, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADER_BYTES = _HEADER.size


class CacheValueError(ValueError):
    """A cached value that must not be used: corrupt, truncated, another format, layout, page or key."""


def _sizes(layout: KVLayoutSpec) -> tuple[tuple[int, ...], tuple[int, ...], int, int, int]:
    """(data shape, scales shape, data bytes, scales bytes, zeros bytes) of one full page in `layout`."""
    data = (2, layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim)
    scales = (*data[:-1], layout.head_dim // max(layout.group_size, 1))
    n_data = math.prod(data) * torch.empty((), dtype=_DTYPES[layout.dtype]).element_size()
    n_scales = math.prod(scales) * 2 if layout.quantized else 0
    n_zeros = n_scales if layout.quantized and layout.asymmetric else 0
    return data, scales, n_data, n_scales, n_zeros


def value_bytes(layout: KVLayoutSpec) -> int:
    """Size of one encoded page value in `layout`."""
    _, _, a, b, c = _sizes(layout)
    return HEADER_BYTES + a + b + c + _CRC.size


def _raw(t: torch.Tensor):
    return t.detach().to("cpu").contiguous().view(torch.uint8).numpy()  # a buffer; join() copies it once


def encode_value(payload: PagePayload, layout: KVLayoutSpec, chain: bytes) -> bytes:
    """Serialize a full page (all layers) stored under key digest `chain`. Raises CacheValueError if the
    payload does not match `layout`."""
    data_shape, scales_shape, *_ = _sizes(layout)
    if len(chain) != 32:
        raise CacheValueError(f"chain hash must be 32 bytes, got {len(chain)}")
    if payload.layer_start != 0 or payload.num_tokens != layout.page_size:
        raise CacheValueError("only full pages of all layers are cached")
    if tuple(payload.data.shape) != data_shape or payload.data.dtype != _DTYPES[layout.dtype]:
        raise CacheValueError(f"payload data {tuple(payload.data.shape)} {payload.data.dtype} does not match "
                              f"layout {data_shape} {layout.dtype}")
    parts = [_raw(payload.data)]
    if layout.quantized:
        if payload.group_size != layout.group_size or payload.scales is None \
                or tuple(payload.scales.shape) != scales_shape or payload.scales.dtype != torch.float16:
            raise CacheValueError(f"payload scales / group size do not match layout {scales_shape}")
        if (payload.zeros is not None) != layout.asymmetric:
            raise CacheValueError(f"payload zeros presence does not match asymmetric={layout.asymmetric}")
        parts.append(_raw(payload.scales))
        if payload.zeros is not None:
            if tuple(payload.zeros.shape) != scales_shape or payload.zeros.dtype != torch.float16:
                raise CacheValueError(f"payload zeros do not match layout {scales_shape}")
            parts.append(_raw(payload.zeros))
    elif payload.group_size or payload.scales is not None or payload.zeros is not None:
        raise CacheValueError("quantized payload for an unquantized layout")
    lens = [p.nbytes for p in parts] + [0] * (3 - len(parts))
    header = _HEADER.pack(MAGIC, VERSION, _DTYPE_CODES[layout.dtype], int(layout.asymmetric), layout.page_size,
                          layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.group_size,
                          payload.num_tokens, payload.page_index, 0, chain, *lens)
    body = b"".join([header, *parts])
    return body + _CRC.pack(zlib.crc32(body))


def decode_value(buf: bytes, layout: KVLayoutSpec, chain: bytes, page_index: int) -> PagePayload:
    """Verify and parse a value expected to hold page `page_index` under key digest `chain` in `layout`.
    Returns a PagePayload of CPU tensors (one copy of `buf`); raises CacheValueError on any mismatch."""
    data_shape, scales_shape, n_data, n_scales, n_zeros = _sizes(layout)
    total = HEADER_BYTES + n_data + n_scales + n_zeros + _CRC.size
    if len(buf) < HEADER_BYTES:
        raise CacheValueError(f"value of {len(buf)} bytes is shorter than the header")
    (magic, version, dtype, flags, page_size, num_layers, num_kv_heads, head_dim, group_size, num_tokens,
     index, reserved, got_chain, l_data, l_scales, l_zeros) = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CacheValueError(f"bad magic {magic!r}")
    if version != VERSION:
        raise CacheValueError(f"unsupported cache value version {version} (want {VERSION})")
    got = (dtype, flags, page_size, num_layers, num_kv_heads, head_dim, group_size, reserved)
    want = (_DTYPE_CODES[layout.dtype], int(layout.asymmetric), layout.page_size, layout.num_layers,
            layout.num_kv_heads, layout.head_dim, layout.group_size, 0)
    if got != want:
        raise CacheValueError(f"layout mismatch: header {got}, expected {want}")
    if got_chain != chain:
        raise CacheValueError("value belongs to another key (chain hash mismatch)")
    if index != page_index or num_tokens != layout.page_size:
        raise CacheValueError(f"value holds page {index} with {num_tokens} tokens, expected full page {page_index}")
    if (l_data, l_scales, l_zeros) != (n_data, n_scales, n_zeros) or len(buf) != total:
        raise CacheValueError(f"value has {len(buf)} bytes (sections {l_data}/{l_scales}/{l_zeros}), layout "
                              f"requires {total} ({n_data}/{n_scales}/{n_zeros})")
    (crc,) = _CRC.unpack_from(buf, total - _CRC.size)
    if zlib.crc32(memoryview(buf)[:total - _CRC.size]) != crc:
        raise CacheValueError(f"checksum mismatch (page {page_index})")
    own = bytearray(buf)  # one copy; the tensors below are views of it

    def section(offset: int, nbytes: int, dt: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        count = nbytes // torch.empty((), dtype=dt).element_size()
        return torch.frombuffer(own, dtype=dt, count=count, offset=offset).view(shape)

    data = section(HEADER_BYTES, n_data, _DTYPES[layout.dtype], data_shape)
    scales = section(HEADER_BYTES + n_data, n_scales, torch.float16, scales_shape) if n_scales else None
    zeros = section(HEADER_BYTES + n_data + n_scales, n_zeros, torch.float16, scales_shape) if n_zeros else None
    return PagePayload(page_index=page_index, num_tokens=num_tokens, layer_start=0, data=data, scales=scales,
                       zeros=zeros, group_size=layout.group_size)
