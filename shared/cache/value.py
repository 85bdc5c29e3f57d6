"""One cached KV page as one self-contained binary value (one atomic Redis value per page).

A value is a fixed header bound to its key, a CRC32C, then the page's raw bytes:

    "PDKC" | u32 value version | chain hash (32 B) | u32 page index | u32 tokens | u32 layers
    | layout (`codec.pack_layout`) | model fingerprint (`codec.pack_str`) | u64 x3 data / scales / zeros bytes
    | u32 CRC32C over everything before it and the three byte blocks | data | scales | zeros

Encoding is one copy of the page bytes (`pdserve.kv.bytes_out.concat`, outside the GIL) and a hardware CRC32C
(outside the GIL too): the write-back of a 2k-token prompt of an 8B model is 128 such values, and it runs beside
the next request's prefill in the same process, so it must hold the GIL for microseconds, not milliseconds (a
protobuf encoding with zlib's CRC holds it for the whole copy and checksum of every page).

`decode_value` parses strictly: every header field against what the caller expects (key, page, full page of all
layers, layout, model), every length against the layout, the checksum, and the values (`check_values`: NaN or
infinite scales, dense NaN / inf, fp8 NaN encodings); any damage or mismatch raises CorruptPage and the caller
treats the page as a miss. The tensors it returns are read-only views of the value.
No pickle anywhere. In the store a value is followed by its MAC tag (value_auth.py, added and checked by the
prompt cache): the CRC catches damage, the MAC catches anyone without the cache secret.
"""

from __future__ import annotations

import functools
import math
import struct

import crc32c
import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.value_auth import TAG_BYTES
from pdserve.errors import CorruptPage, InvalidRequest
from pdserve.kv.bytes_out import concat, tensor_view
from pdserve.kv.codec import KVLayoutSpec, check_values, pack_layout, pack_str, unusable_bits
from pdserve.kv.dtypes import DTYPES
from pdserve.kv.payload import PagePayload

CHAIN_BYTES = 32  # a chain hash (sha256 digest), see keys.py
MAGIC = b"PDKC"
VALUE_VERSION = 1
_FIXED = struct.Struct(f"<4sI{CHAIN_BYTES}sIII")  # magic, version, chain, page index, tokens, layers
_LENGTHS = struct.Struct("<QQQ")
_CRC = struct.Struct("<I")


def _shapes(layout: KVLayoutSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    data = (2, layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim)
    return data, (*data[:-1], layout.head_dim // max(layout.group_size, 1))


@functools.lru_cache(maxsize=64)
def _block_bytes(layout: KVLayoutSpec) -> tuple[int, int, int]:
    """(data, scales, zeros) bytes of a full page of all layers in `layout`."""
    data, groups = _shapes(layout)
    n_data = math.prod(data) * DTYPES[layout.dtype].itemsize
    n_scales = math.prod(groups) * 2 if layout.quantized else 0  # float16
    return n_data, n_scales, n_scales if layout.quantized and layout.asymmetric else 0


@functools.lru_cache(maxsize=64)
def _header_tail(layout: KVLayoutSpec, fingerprint: str) -> bytes:
    """The header after its fixed part: the same for every page of a namespace (built once, not per page)."""
    return pack_layout(layout.to_proto()) + pack_str(fingerprint) + _LENGTHS.pack(*_block_bytes(layout))


def _header(ns: CacheNamespace, chain: bytes, page_index: int) -> bytes:
    lay = ns.layout
    fixed = _FIXED.pack(MAGIC, VALUE_VERSION, chain, page_index, lay.page_size, lay.num_layers)
    return fixed + _header_tail(lay, ns.fingerprint)


def _bytes_of(t: torch.Tensor | None) -> memoryview:
    if t is None:
        return memoryview(b"")
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def encode_value(payload: PagePayload, ns: CacheNamespace, chain: bytes) -> bytes:
    """Serialize a full page (all layers, CPU tensors) stored under key digest `chain`. Raises InvalidRequest if
    the payload does not fit `ns.layout` or is not a full page of all layers."""
    if len(chain) != CHAIN_BYTES:
        raise InvalidRequest(f"chain hash must be {CHAIN_BYTES} bytes, got {len(chain)}")
    lay = ns.layout
    if (
        payload.layer_start != 0
        or payload.num_tokens != lay.page_size
        or payload.data.dim() != 5
        or payload.layer_count != lay.num_layers
    ):
        raise InvalidRequest("only full pages of all layers are cached")
    data_shape, scales_shape = _shapes(lay)
    if tuple(payload.data.shape) != data_shape or payload.data.dtype != lay.torch_dtype:
        raise InvalidRequest(f"payload data {tuple(payload.data.shape)} {payload.data.dtype} does not fit {lay}")
    if lay.quantized:
        if payload.group_size != lay.group_size or (payload.zeros is not None) != lay.asymmetric:
            raise InvalidRequest(f"payload quantization does not fit {lay}")
        for t in (payload.scales, payload.zeros):
            if t is not None and (tuple(t.shape) != scales_shape or t.dtype != torch.float16):
                raise InvalidRequest(f"payload scales / zeros do not fit {lay}: want {scales_shape} float16")
        if payload.scales is None:
            raise InvalidRequest(f"payload has no scales for {lay}")
    elif payload.group_size or payload.scales is not None or payload.zeros is not None:
        raise InvalidRequest("quantized payload for an unquantized layout")
    header = _header(ns, chain, payload.page_index)
    blocks = [_bytes_of(payload.data), _bytes_of(payload.scales), _bytes_of(payload.zeros)]
    crc = crc32c.crc32c(header)
    for b in blocks:
        crc = crc32c.crc32c(b, crc)
    return concat([header, _CRC.pack(crc), *blocks])  # the page bytes copied outside the GIL


def encode_row(row: torch.Tensor, ns: CacheNamespace, chain: bytes, page_index: int) -> tuple[bytes, PagePayload]:
    """The value of a full page given as its transfer row (uint8 [page_bytes], `page_format`: data | scales | zeros,
    the same bytes in the same order as a value's blocks), and the page as read-only views of that value: one
    copy of the page in all, where `encode_value` of a payload split from the row makes two."""
    if len(chain) != CHAIN_BYTES:
        raise InvalidRequest(f"chain hash must be {CHAIN_BYTES} bytes, got {len(chain)}")
    sizes = _block_bytes(ns.layout)
    if row.dtype != torch.uint8 or row.dim() != 1 or row.numel() != sum(sizes) or row.device.type != "cpu":
        raise InvalidRequest(f"page row {tuple(row.shape)} {row.dtype} != [{sum(sizes)}] uint8 on the CPU")
    header = _header(ns, chain, page_index)
    body = _bytes_of(row)
    value = concat([header, _CRC.pack(crc32c.crc32c(body, crc32c.crc32c(header))), body])
    return value, _payload_views(memoryview(value)[len(header) + _CRC.size :], ns.layout, page_index)


def _payload_views(blocks: memoryview, lay: KVLayoutSpec, page_index: int) -> PagePayload:
    """A full page as read-only views of its value's blocks (data | scales | zeros)."""
    n_data, n_scales, n_zeros = _block_bytes(lay)
    data_shape, scales_shape = _shapes(lay)
    data = tensor_view(blocks[:n_data], lay.torch_dtype).view(data_shape)  # readers only: pool imports copy
    end = n_data + n_scales
    scales = tensor_view(blocks[n_data:end], torch.float16).view(scales_shape) if n_scales else None
    zeros = tensor_view(blocks[end : end + n_zeros], torch.float16).view(scales_shape) if n_zeros else None
    return PagePayload(page_index, lay.page_size, 0, data, scales, zeros, lay.group_size)


def decode_value(buf: bytes | memoryview, ns: CacheNamespace, chain: bytes, page_index: int) -> PagePayload:
    """Verify and parse a value expected to hold page `page_index` under key digest `chain` in `ns`.
    Returns a PagePayload of read-only CPU views of `buf`; raises CorruptPage on any damage or mismatch."""
    lay = ns.layout
    view = memoryview(buf)
    if len(view) < _FIXED.size or bytes(view[:4]) != MAGIC:
        raise CorruptPage(f"not a KV page value ({len(view)} bytes)")
    _, version, got_chain, got_index, tokens, layers = _FIXED.unpack_from(view)
    if version != VALUE_VERSION:
        raise CorruptPage(f"value version {version}, this build reads {VALUE_VERSION}")
    if got_chain != chain:
        raise CorruptPage("value belongs to another key (chain hash differs)")
    if got_index != page_index or tokens != lay.page_size or layers != lay.num_layers:
        raise CorruptPage(
            f"value holds page {got_index} ({tokens} tokens, {layers} layers), expected full page {page_index}"
        )
    want = _header(ns, chain, page_index)
    n = len(want)
    if len(view) < n + _CRC.size:
        raise CorruptPage(f"value truncated in its header ({len(view)} bytes)")
    if view[:n] != want:  # the fixed part matched: what differs is the layout, the model or the lengths
        lay_at = _FIXED.size
        lay_end = lay_at + len(pack_layout(lay.to_proto()))
        if view[lay_at:lay_end] != want[lay_at:lay_end]:
            raise CorruptPage(f"value layout differs from {lay}")
        fp_end = lay_end + len(pack_str(ns.fingerprint))
        if view[lay_end:fp_end] != want[lay_end:fp_end]:
            raise CorruptPage(f"value model fingerprint differs from {ns.fingerprint!r}")
        raise CorruptPage("value block lengths differ from the layout's")
    sizes = _block_bytes(lay)
    if len(view) != n + _CRC.size + sum(sizes):
        raise CorruptPage(f"value has {len(view)} bytes, its header requires {n + _CRC.size + sum(sizes)}")
    (crc,) = _CRC.unpack_from(view, n)
    at = n + _CRC.size
    blocks = []
    for size in sizes:
        blocks.append(view[at : at + size])
        at += size
    got = crc32c.crc32c(view[:n])
    for b in blocks:
        got = crc32c.crc32c(b, got)
    if got != crc:
        raise CorruptPage(f"value checksum mismatch (page {page_index})")
    page = _payload_views(view[n + _CRC.size :], lay, page_index)
    check_values(page.data, page.scales, page.zeros)  # a checksum proves only that the writer meant these values
    return page


def expected_header(ns: CacheNamespace, chain: bytes, page_index: int) -> bytes:
    """The header a value of page `page_index` under `chain` in `ns` starts with (what `decode_value` compares)."""
    return _header(ns, chain, page_index)


def block_checks(layout: KVLayoutSpec) -> list[list[int]]:
    """[bytes, item size, unusable-bits mask] of a value's data, scales and zeros blocks: what a process without
    torch needs to check a value's values as `decode_value` does (`fetch_worker.check_value`)."""
    return [[size, *unusable_bits(dtype)] for size, dtype, _ in value_blocks(layout)]


def checked_page(value: memoryview, ns: CacheNamespace, page_index: int) -> PagePayload:
    """The page of a value whose header, checksum and values were checked already (`fetch_worker.check_value`, in
    the prefix fetch's helper process), as read-only views of it."""
    return _payload_views(value[value_header_bytes(ns) :], ns.layout, page_index)


def encoded_bytes(ns: CacheNamespace, page_index: int) -> int:
    """Size of the encoded value of a page in `ns` (the same for every page index)."""
    return len(_header(ns, bytes(CHAIN_BYTES), page_index)) + _CRC.size + sum(_block_bytes(ns.layout))


def value_header_bytes(ns: CacheNamespace) -> int:
    """Bytes of a value before its page data: the header and the CRC (the same for every page of `ns`)."""
    return len(_header(ns, bytes(CHAIN_BYTES), 0)) + _CRC.size


def value_blocks(layout: KVLayoutSpec) -> list[tuple[int, torch.dtype, tuple[int, ...]]]:
    """(bytes, dtype, shape of one page) of a value's data, scales and zeros blocks, in order (0 bytes: absent)."""
    n_data, n_scales, n_zeros = _block_bytes(layout)
    data_shape, scales_shape = _shapes(layout)
    return [
        (n_data, layout.torch_dtype, data_shape),
        (n_scales, torch.float16, scales_shape),
        (n_zeros, torch.float16, scales_shape),
    ]


def value_bytes(ns: CacheNamespace, page_index: int) -> int:
    """Size of a page's value in the store: the encoded value and its MAC tag."""
    return encoded_bytes(ns, page_index) + TAG_BYTES
