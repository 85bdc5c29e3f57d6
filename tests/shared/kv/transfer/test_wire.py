"""Batch layout and wire: pack/unpack round trips, the hand-written batch message is valid protobuf and parses
back without copying the payload, and every damaged or disagreeing batch raises CorruptPage."""

from __future__ import annotations

import pytest
import torch

from pdserve.errors import CorruptPage
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.wire import (
    BatchExpectation,
    batch_message_bytes,
    make_header,
    parse_server_message,
    verify_header,
)
from pdserve.v1 import internal_pb2

LAYOUTS = [
    KVLayoutSpec("int8", page_size=4, num_layers=2, num_kv_heads=2, head_dim=16, group_size=8),
    KVLayoutSpec("int8", page_size=4, num_layers=2, num_kv_heads=2, head_dim=16, group_size=8, asymmetric=True),
    KVLayoutSpec("float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=16),
    KVLayoutSpec("bfloat16", page_size=4, num_layers=2, num_kv_heads=2, head_dim=16),
]


def random_rows(fmt: PageFormat, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, fmt.page_bytes), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l.dtype}-{l.asymmetric}")
def test_payloads_rows_round_trip(layout):
    fmt = PageFormat(layout)
    g = torch.Generator().manual_seed(1)
    pays = []
    for i, k in enumerate([4, 4, 3]):
        data = torch.randn(2, 2, k, 2, 16, generator=g).to(layout.torch_dtype)
        if layout.quantized:
            data = torch.randint(-128, 127, (2, 2, k, 2, 16), dtype=torch.int8, generator=g)
        sc = torch.rand(2, 2, k, 2, 2, generator=g).half() if layout.quantized else None
        z = torch.rand(2, 2, k, 2, 2, generator=g).half() if layout.asymmetric else None
        pays.append(PagePayload(i, k, 0, data, sc, z, layout.group_size))
    rows = fmt.rows_from_payloads(pays)
    assert rows.shape == (3, fmt.page_bytes) and rows.dtype == torch.uint8
    data, _, _ = fmt.unpack(rows)
    assert not data[2, :, :, 3:].any()  # the partial page's tail is zero
    back = fmt.payloads(rows, [0, 1, 2], [4, 4, 3])
    for a, b in zip(pays, back):
        assert a.page_index == b.page_index and a.num_tokens == b.num_tokens
        for x, y in ((a.data, b.data), (a.scales, b.scales), (a.zeros, b.zeros)):
            assert (x is None and y is None) or torch.equal(x, y)


def test_batch_message_is_protobuf_and_parses_back_without_copy():
    layout = LAYOUTS[0]
    fmt = PageFormat(layout)
    rows = random_rows(fmt, 3)
    payload = memoryview(rows.numpy()).cast("B")
    h = make_header(
        request_id="r",
        fingerprint="fp",
        layout=layout,
        first_seq_no=5,
        page_indexes=[5, 6, 7],
        num_tokens=[4, 4, 2],
        payload=payload,
    )
    raw = batch_message_bytes(h, payload)
    std = internal_pb2.PrefillServerMessage.FromString(raw)  # any protobuf reader
    assert std.batch.header == h and std.batch.payload == payload.tobytes()
    msg, header, view = parse_server_message(raw)
    assert msg is None and header == h and isinstance(view, memoryview) and view.obj is raw
    verify_header(header, BatchExpectation(layout, "fp", "r"), view)
    other = internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(first_token_id=3)).SerializeToString()
    msg, header, view = parse_server_message(other)
    assert msg.done.first_token_id == 3 and header is None and view is None


def _header(layout=LAYOUTS[0], **kw):
    fmt = PageFormat(layout)
    rows = random_rows(fmt, 2)
    payload = memoryview(rows.numpy()).cast("B")
    args = dict(request_id="r", fingerprint="fp", layout=layout, first_seq_no=0, page_indexes=[0, 1], num_tokens=[4, 4])
    args.update(kw)
    return make_header(**args, payload=payload), bytearray(payload)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda h, p: setattr(h, "request_id", "other"), "request id"),
        (lambda h, p: setattr(h, "model_fingerprint", "x"), "fingerprint"),
        (lambda h, p: setattr(h.layout, "head_dim", 32), "layout"),
        (lambda h, p: setattr(h, "nbytes", h.nbytes + 1), "bytes"),
        (lambda h, p: h.num_tokens.__setitem__(0, 9), "num_tokens"),
        (lambda h, p: h.num_tokens.append(1), "token counts"),
        (lambda h, p: p.__setitem__(17, p[17] ^ 1), "checksum"),
        (lambda h, p: setattr(h, "first_seq_no", 1), "checksum"),  # the header is covered too
        (lambda h, p: p.extend(b"x"), "payload"),
        (lambda h, p: setattr(h, "has_checksum", False), "no checksum"),
    ],
)
def test_damaged_or_foreign_batch_is_corrupt(damage, reason):
    h, p = _header()
    damage(h, p)
    with pytest.raises(CorruptPage, match=reason):
        verify_header(h, BatchExpectation(LAYOUTS[0], "fp", "r"), memoryview(bytes(p)))


def test_malformed_batch_message_is_corrupt():
    h, p = _header()
    raw = batch_message_bytes(h, memoryview(bytes(p)))
    with pytest.raises(CorruptPage):
        parse_server_message(raw[:-3])  # truncated
    with pytest.raises(CorruptPage):
        parse_server_message(raw + b"\x00")  # trailing byte


@pytest.mark.parametrize("raw", [b"\x0a\xff\xff", b"\x12\x05abc", b"\xff\xff\xff\xff"])
def test_unparseable_prefill_message_is_a_corrupt_page(raw):
    """Bytes that are no PrefillServerMessage (or a batch whose header is no KVBatchHeader) raise CorruptPage
    (DATA_LOSS at decode), not protobuf's DecodeError (which surfaced as UNKNOWN)."""
    with pytest.raises(CorruptPage):
        parse_server_message(raw)
    header = b"\x0a\x03\xff\xff\xff"  # batch field 1 (header) holding 3 bytes that are no KVBatchHeader
    inner = header + b"\x12\x01x"
    with pytest.raises(CorruptPage):
        parse_server_message(b"\x52" + bytes([len(inner)]) + inner)
