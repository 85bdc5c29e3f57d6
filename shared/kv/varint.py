"""Protobuf base-128 varints, for the messages written and read by hand (`transfer.wire`, the shippers' frames)."""

from __future__ import annotations

from pdserve.errors import CorruptPage


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); CorruptPage when truncated or over 64 bits."""
    n = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise CorruptPage("truncated or oversized varint in a KV message")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, pos
        shift += 7
