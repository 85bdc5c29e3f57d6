"""A shipment written by hand reads back (and through protobuf); anything else is CorruptPage, never a guess."""

from __future__ import annotations

import pytest

from pdserve.errors import CorruptPage
from pdserve.kv.shipper.frames import parse_shipment, shipment_bytes
from pdserve.kv.varint import encode_varint
from pdserve.v1 import kv_pb2

KEY = bytes(range(16))


@pytest.mark.parametrize("n", [0, 1, 1 << 16, (1 << 20) + 3])
def test_a_shipment_reads_back_and_is_protobuf(n):
    payload = bytes((i * 7) & 0xFF for i in range(n))
    raw = shipment_bytes(KEY, 2**40 + 5, memoryview(payload))
    key, seq, got = parse_shipment(raw)
    assert (key, seq, bytes(got)) == (KEY, 2**40 + 5, payload)
    msg = kv_pb2.KVShipment.FromString(raw)
    assert (msg.transfer_key, msg.seq_no, msg.payload) == (KEY, 2**40 + 5, payload)
    # protobuf's own bytes read the same (it leaves an empty payload out)
    assert bytes(parse_shipment(msg.SerializeToString())[2]) == payload
    assert parse_shipment(kv_pb2.KVShipment(transfer_key=KEY).SerializeToString())[1:] == (0, memoryview(b""))


def test_bad_shipments_are_corrupt():
    good = kv_pb2.KVShipment(transfer_key=KEY, seq_no=3, payload=b"abc").SerializeToString()
    cases = {
        "truncated": good[:-1],
        "no key": kv_pb2.KVShipment(seq_no=3, payload=b"x").SerializeToString(),
        "short key": kv_pb2.KVShipment(transfer_key=b"k", seq_no=3, payload=b"x").SerializeToString(),
        "unknown field": good + bytes([0x22, 0]),
        "repeated payload": good + bytes([0x1A, 1]) + b"y",
        "length past the end": bytes([0x0A]) + encode_varint(1 << 30) + KEY,
        "oversized varint": bytes([0x10]) + b"\xff" * 11,
    }
    for why, raw in cases.items():
        with pytest.raises(CorruptPage):
            parse_shipment(raw)
            pytest.fail(why)
