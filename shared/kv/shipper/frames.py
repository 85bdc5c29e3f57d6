"""What shippers exchange, torch-free: a batch's bytes between shippers (`KVShipment`, written and read by hand so
the payload is copied once on each end) and the protobuf messages between an engine process and its shipper (one
frame each on their socket pair: `<I` length + body, `pdserve.cache.fetch_worker`'s framing).
"""

from __future__ import annotations

import ctypes
import socket

import numpy as np

from pdserve.cache.fetch_worker import recv_frame, send_frame
from pdserve.errors import CorruptPage
from pdserve.kv.varint import encode_varint, read_varint
from pdserve.v1 import kv_pb2

KEY_BYTES = 16  # a transfer key: random, chosen by decode per request
_KEY_TAG, _SEQ_TAG, _PAYLOAD_TAG = 0x0A, 0x10, 0x1A  # KVShipment.transfer_key = 1, .seq_no = 2, .payload = 3
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
CONTROL_FRAME_LIMIT = 1 << 16  # control messages are a few dozen bytes


def address_of(buf) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers included)."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def memmove(dst_address: int, src, n: int) -> None:
    """Copy `n` bytes of buffer `src` to an address; a ctypes call, so the GIL is released during the copy."""
    if n:
        ctypes.memmove(dst_address, address_of(src), n)


def shipment_bytes(key: bytes, seq_no: int, payload: memoryview) -> bytes:
    """A serialized KVShipment whose payload is `payload` (copied once, outside the GIL)."""
    n = payload.nbytes
    head = b"".join(
        [bytes([_KEY_TAG]), encode_varint(len(key)), key, bytes([_SEQ_TAG]), encode_varint(seq_no)]
        + [bytes([_PAYLOAD_TAG]), encode_varint(n)]
    )
    out = _new_bytes(None, len(head) + n)  # uninitialized: nothing else sees it before it is filled
    at = address_of(out)
    ctypes.memmove(at, head, len(head))
    memmove(at + len(head), payload, n)
    return out


def parse_shipment(raw: bytes) -> tuple[bytes, int, memoryview]:
    """(transfer key, seq_no, payload as a view of `raw`); CorruptPage when `raw` is not a KVShipment with a key
    (any field order, each field at most once; seq_no and payload left out are 0 and empty, as protobuf writes
    them)."""
    buf = memoryview(raw)
    key = seq = payload = None
    pos = 0
    while pos < len(buf):
        tag = buf[pos]
        if tag == _SEQ_TAG and seq is None:
            seq, pos = read_varint(buf, pos + 1)
            continue
        if tag not in (_KEY_TAG, _PAYLOAD_TAG):
            raise CorruptPage(f"unexpected field tag {tag} in a KV shipment")
        length, start = read_varint(buf, pos + 1)
        end = start + length
        if end > len(buf):
            raise CorruptPage("KV shipment field runs past the message")
        if tag == _KEY_TAG and key is None:
            key = buf[start:end].tobytes()
        elif tag == _PAYLOAD_TAG and payload is None:
            payload = buf[start:end]
        else:
            raise CorruptPage("KV shipment field repeated")
        pos = end
    if key is None:
        raise CorruptPage("KV shipment lacks its transfer key")
    if len(key) != KEY_BYTES:
        raise CorruptPage(f"KV shipment key of {len(key)} bytes, not {KEY_BYTES}")
    return key, seq or 0, payload if payload is not None else memoryview(b"")  # proto3: defaults are left out


def send_message(sock: socket.socket, msg) -> None:
    """One control message (ShipperCommand / ShipperEvent) as a frame."""
    send_frame(sock, [msg.SerializeToString()])


def recv_command(sock: socket.socket) -> kv_pb2.ShipperCommand | None:
    """The next command from the engine process; None when it closed the link."""
    body = recv_frame(sock, limit=CONTROL_FRAME_LIMIT)
    return None if body is None else kv_pb2.ShipperCommand.FromString(bytes(body))


def recv_event(sock: socket.socket) -> kv_pb2.ShipperEvent | None:
    """The next event from the shipper; None when it closed the link (it exited)."""
    body = recv_frame(sock, limit=CONTROL_FRAME_LIMIT)
    return None if body is None else kv_pb2.ShipperEvent.FromString(bytes(body))
