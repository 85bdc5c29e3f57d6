"""Batch headers on the wire: building, CRC32C checksum, strict verification, and the batch message's bytes
written and read without copying the payload through protobuf.

`batch_message_bytes` writes a `PrefillServerMessage{batch: KVPageBatch{header, payload}}` exactly as protobuf
would (any protobuf reader parses it), joining the small prefix with the payload in one copy: the only copy
gRPC needs. `parse_server_message` reads that shape back, giving the payload as a memoryview of the received
bytes; any other message goes through protobuf.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c
from google.protobuf.message import DecodeError

from pdserve.errors import CorruptPage
from pdserve.kv.bytes_out import concat
from pdserve.kv.codec import KVLayoutSpec, pack_layout, pack_str
from pdserve.kv.transfer.layers import LayerRange
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.varint import encode_varint as _varint
from pdserve.kv.varint import read_varint as _read_varint
from pdserve.v1 import internal_pb2, kv_pb2

_BATCH_FIELD = internal_pb2.PrefillServerMessage.DESCRIPTOR.fields_by_name["batch"].number
_OUTER_TAG = bytes([(_BATCH_FIELD << 3) | 2])  # length-delimited field `batch`
_HEADER_TAG, _PAYLOAD_TAG = 0x0A, 0x12  # KVPageBatch.header = 1, .payload = 2 (length-delimited)


def canonical_header(h: kv_pb2.KVBatchHeader) -> bytes:
    """Every header field except the checksum, in a fixed byte order (what the checksum covers). The layer range
    only when set (a whole-page batch's bytes are those of peers that predate layer groups)."""
    parts = [
        b"PDKB",
        pack_str(h.request_id),
        pack_str(h.model_fingerprint),
        pack_layout(h.layout),
        struct.pack("<QQQB", h.first_seq_no, len(h.page_indexes), h.nbytes, int(h.has_checksum)),
        struct.pack(f"<{len(h.page_indexes)}I", *h.page_indexes),
        struct.pack(f"<{len(h.num_tokens)}I", *h.num_tokens),
    ]
    if h.layer_count:
        parts.append(struct.pack("<4sII", b"LAYR", h.layer_start, h.layer_count))
    return b"".join(parts)


def checksum(h: kv_pb2.KVBatchHeader, payload) -> int:
    """CRC32C (hardware, GIL released) over the canonical header and the payload (any buffer)."""
    return crc32c.crc32c(payload, crc32c.crc32c(canonical_header(h)))


def make_header(
    *,
    request_id: str,
    fingerprint: str,
    layout: KVLayoutSpec,
    first_seq_no: int,
    page_indexes: list[int],
    num_tokens: list[int],
    payload=None,
    layers: LayerRange | None = None,
) -> kv_pb2.KVBatchHeader:
    """A header for N pages (`layers` of each; None: all); with `payload` (the [N, page_bytes] bytes of those
    layers) it carries their checksum."""
    partial = layers is not None and not layers.is_all(layout.num_layers)
    fmt = PageFormat(layout, layers.count if partial and layers is not None else 0)
    h = kv_pb2.KVBatchHeader(
        request_id=request_id,
        model_fingerprint=fingerprint,
        layout=layout.to_proto(),
        first_seq_no=first_seq_no,
        page_indexes=page_indexes,
        num_tokens=num_tokens,
        nbytes=len(page_indexes) * fmt.page_bytes,
        has_checksum=payload is not None,
    )
    if partial and layers is not None:
        h.layer_start, h.layer_count = layers.start, layers.count
    if payload is not None:
        h.checksum = checksum(h, payload)
    return h


@dataclass(frozen=True)
class BatchExpectation:
    """What a receiver accepts: its layout, model and request."""

    layout: KVLayoutSpec
    fingerprint: str
    request_id: str


def verify_header(h: kv_pb2.KVBatchHeader, want: BatchExpectation, payload=None) -> None:
    """Raise CorruptPage unless the header fits what the receiver expects (and `payload`, when given, has the
    announced size and checksum). Called before any byte reaches the pool."""
    if not h.HasField("layout"):
        raise CorruptPage("batch has no layout")
    try:
        layout = KVLayoutSpec.from_proto(h.layout)
    except Exception as e:
        raise CorruptPage(f"batch layout: {e}") from None
    if layout != want.layout:
        raise CorruptPage(f"layout mismatch: got {layout}, expected {want.layout}")
    if h.model_fingerprint != want.fingerprint:
        raise CorruptPage(f"model fingerprint mismatch: got {h.model_fingerprint!r}, expected {want.fingerprint!r}")
    if h.request_id != want.request_id:
        raise CorruptPage(f"request id mismatch: got {h.request_id!r}, expected {want.request_id!r}")
    n = len(h.page_indexes)
    if n == 0 or len(h.num_tokens) != n:
        raise CorruptPage(f"batch has {n} page indexes and {len(h.num_tokens)} token counts")
    bad = [k for k in h.num_tokens if not 1 <= k <= layout.page_size]
    if bad:
        raise CorruptPage(f"num_tokens {bad[0]} outside [1, page_size {layout.page_size}]")
    layers = header_layers(h, layout)  # CorruptPage outside the model's layers
    want_bytes = n * PageFormat(layout, layers.count).page_bytes
    if h.nbytes != want_bytes:
        raise CorruptPage(f"batch announces {h.nbytes} bytes, layout and {n} pages require {want_bytes}")
    if payload is not None:
        if not h.has_checksum:
            raise CorruptPage("batch with bytes but no checksum")
        if len(payload) != want_bytes:
            raise CorruptPage(f"batch payload has {len(payload)} bytes, header requires {want_bytes}")
        if checksum(h, payload) != h.checksum:
            raise CorruptPage(f"checksum mismatch (pages from seq_no {h.first_seq_no})")


def header_layers(h: kv_pb2.KVBatchHeader, layout: KVLayoutSpec) -> LayerRange:
    """The layers a batch carries (all of them when its header names none); CorruptPage outside the model's."""
    if h.layer_count == 0:
        if h.layer_start:
            raise CorruptPage(f"batch names layer_start {h.layer_start} without a layer_count")
        return LayerRange(0, layout.num_layers)
    if h.layer_start + h.layer_count > layout.num_layers:
        raise CorruptPage(
            f"batch layers [{h.layer_start}, {h.layer_start + h.layer_count}) outside the model's {layout.num_layers}"
        )
    return LayerRange(h.layer_start, h.layer_start + h.layer_count)


def batch_message_bytes(header: kv_pb2.KVBatchHeader, payload) -> bytes:
    """The serialized PrefillServerMessage{batch: KVPageBatch{header, payload}}; `payload` is any contiguous
    buffer (a pinned host tensor's memoryview), copied once into the result."""
    hb = header.SerializeToString()
    n = memoryview(payload).nbytes
    inner = [bytes([_HEADER_TAG]), _varint(len(hb)), hb, bytes([_PAYLOAD_TAG]), _varint(n)]
    inner_len = sum(len(x) for x in inner) + n
    return concat([_OUTER_TAG, _varint(inner_len), *inner, payload])  # the payload copied outside the GIL


def parse_server_message(
    raw: bytes,
) -> tuple[internal_pb2.PrefillServerMessage | None, kv_pb2.KVBatchHeader | None, memoryview | None]:
    """(message, None, None) for any message but a batch; (None, header, payload view) for a batch. Raises
    CorruptPage for a malformed batch."""
    buf = memoryview(raw)
    if not raw.startswith(_OUTER_TAG):
        try:
            return internal_pb2.PrefillServerMessage.FromString(raw), None, None
        except DecodeError as e:
            raise CorruptPage(f"prefill message does not parse: {e}") from None
    inner_len, pos = _read_varint(buf, 1)
    if pos + inner_len != len(buf):
        raise CorruptPage("KV batch message has trailing or missing bytes")
    header = payload = None
    while pos < len(buf):
        tag = buf[pos]
        length, start = _read_varint(buf, pos + 1)
        end = start + length
        if end > len(buf):
            raise CorruptPage("KV batch field runs past the message")
        if tag == _HEADER_TAG and header is None:
            try:
                header = kv_pb2.KVBatchHeader.FromString(buf[start:end].tobytes())
            except DecodeError as e:
                raise CorruptPage(f"KV batch header does not parse: {e}") from None
        elif tag == _PAYLOAD_TAG and payload is None:
            payload = buf[start:end]
        else:
            raise CorruptPage(f"unexpected field tag {tag} in a KV batch")
        pos = end
    if header is None or payload is None:
        raise CorruptPage("KV batch without header or payload")
    return None, header, payload
