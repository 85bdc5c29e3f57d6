"""Cached page values (raw page bytes behind a header bound to their key, CRC32C): round trip, and every kind of
damage is detected."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cache_testutil import DENSE, INT8, make_page, namespace

from pdserve.cache.value import decode_value, encode_row, encode_value, encoded_bytes, value_bytes
from pdserve.cache.value_auth import TAG_BYTES
from pdserve.errors import CorruptPage, InvalidRequest
from pdserve.kv.transfer.page_format import PageFormat

CHAIN = bytes(range(32))
LAYOUTS = {
    "int8": INT8,
    "int8-asym": dataclasses.replace(INT8, asymmetric=True),
    "float32": DENSE,
    "bfloat16": dataclasses.replace(DENSE, dtype="bfloat16"),
    "fp8": dataclasses.replace(INT8, dtype="fp8", group_size=8),
}
NS = namespace(INT8)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip(name):
    ns = namespace(LAYOUTS[name])
    for index in (0, 3, 300):
        page = make_page(ns.layout, index)
        buf = encode_value(page, ns, CHAIN)
        assert len(buf) == encoded_bytes(ns, index) == value_bytes(ns, index) - TAG_BYTES  # stored with a tag
        got = decode_value(buf, ns, CHAIN, index)
        assert got.page_index == index and got.num_tokens == ns.layout.page_size
        assert got.group_size == ns.layout.group_size
        for a, b in ((got.data, page.data), (got.scales, page.scales), (got.zeros, page.zeros)):
            assert (a is None and b is None) or (
                a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            )


def test_int8_value_overhead_is_small():
    page = make_page(INT8, 1)
    assert page.nbytes < value_bytes(NS, 1) < page.nbytes + 200


def test_every_flipped_byte_and_truncation_detected():
    buf = encode_value(make_page(INT8, 1), NS, CHAIN)
    for i in range(len(buf)):
        bad = bytearray(buf)
        bad[i] ^= 0x5A
        with pytest.raises(CorruptPage):
            decode_value(bytes(bad), NS, CHAIN, 1)
    for n in (0, 3, 100, len(buf) // 2, len(buf) - 1):
        with pytest.raises(CorruptPage):
            decode_value(buf[:n], NS, CHAIN, 1)
    with pytest.raises(CorruptPage):
        decode_value(buf + b"\0", NS, CHAIN, 1)


def test_mismatches_rejected():
    buf = encode_value(make_page(INT8, 2), NS, CHAIN)
    with pytest.raises(CorruptPage, match="another key"):  # the value of another key
        decode_value(buf, NS, bytes(32), 2)
    with pytest.raises(CorruptPage, match="page"):
        decode_value(buf, NS, CHAIN, 1)
    with pytest.raises(CorruptPage, match="layout"):
        decode_value(buf, namespace(dataclasses.replace(INT8, group_size=8)), CHAIN, 2)
    with pytest.raises(CorruptPage, match="fingerprint"):
        decode_value(buf, namespace(INT8, fingerprint="fp-other"), CHAIN, 2)
    with pytest.raises(CorruptPage, match="not a KV page value"):
        decode_value(b"PICKLE" + buf[6:], NS, CHAIN, 2)


def test_encode_refuses_pages_that_do_not_fit():
    page = make_page(INT8, 0)
    for bad in (
        dataclasses.replace(page, num_tokens=INT8.page_size - 1),
        dataclasses.replace(page, layer_start=1),
        dataclasses.replace(page, data=page.data[:, :1], scales=page.scales[:, :1]),
    ):
        with pytest.raises(InvalidRequest, match="full pages"):
            encode_value(bad, NS, CHAIN)
    with pytest.raises(InvalidRequest):
        encode_value(make_page(DENSE, 0), NS, CHAIN)
    with pytest.raises(InvalidRequest):
        encode_value(page, namespace(DENSE), CHAIN)
    with pytest.raises(InvalidRequest, match="chain"):
        encode_value(page, NS, CHAIN[:31])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_encode_row_is_encode_value_of_the_same_page(name):
    """A page's transfer row encodes to the very value its payload does (one copy instead of two), and the page it
    returns (views of that value) holds the same bytes."""
    ns = namespace(LAYOUTS[name])
    fmt = PageFormat(ns.layout)
    pages = [make_page(ns.layout, i) for i in range(3)]
    rows = fmt.pack(
        torch.stack([p.data for p in pages]),
        None if pages[0].scales is None else torch.stack([p.scales for p in pages]),
        None if pages[0].zeros is None else torch.stack([p.zeros for p in pages]),
    )
    for i, page in enumerate(pages):
        value, views = encode_row(rows[i], ns, CHAIN, i)
        assert value == encode_value(page, ns, CHAIN)
        for a, b in ((views.data, page.data), (views.scales, page.scales), (views.zeros, page.zeros)):
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert views.page_index == i and views.group_size == ns.layout.group_size
        assert decode_value(value, ns, CHAIN, i).data.data_ptr() != 0


def test_encode_row_refuses_rows_that_do_not_fit():
    row = PageFormat(NS.layout).pack(make_page(NS.layout, 0).data[None], make_page(NS.layout, 0).scales[None], None)[0]
    with pytest.raises(InvalidRequest, match="page row"):
        encode_row(row[:-1], NS, CHAIN, 0)
    with pytest.raises(InvalidRequest, match="page row"):
        encode_row(row.view(torch.int8), NS, CHAIN, 0)
    with pytest.raises(InvalidRequest, match="chain hash"):
        encode_row(row, NS, CHAIN[:5], 0)
