"""Cached page values: round trip, and every kind of damage is detected."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cache_testutil import DENSE, INT8, make_page
from pdserve.cache.page_format import HEADER_BYTES, CacheValueError, decode_value, encode_value, value_bytes

CHAIN = bytes(range(32))
LAYOUTS = {"int8": INT8, "int8-asym": dataclasses.replace(INT8, asymmetric=True), "float32": DENSE,
           "bfloat16": dataclasses.replace(DENSE, dtype="bfloat16")}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip(name):
    layout = LAYOUTS[name]
    page = make_page(layout, 3)
    buf = encode_value(page, layout, CHAIN)
    assert len(buf) == value_bytes(layout)
    got = decode_value(buf, layout, CHAIN, 3)
    assert got.page_index == 3 and got.num_tokens == layout.page_size and got.group_size == layout.group_size
    for a, b in ((got.data, page.data), (got.scales, page.scales), (got.zeros, page.zeros)):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))


def test_int8_value_size_is_data_scales_header():
    page = make_page(INT8, 0)
    assert value_bytes(INT8) == HEADER_BYTES + page.nbytes + 4


def test_every_flipped_byte_and_truncation_detected():
    buf = encode_value(make_page(INT8, 1), INT8, CHAIN)
    for i in range(len(buf)):
        bad = bytearray(buf)
        bad[i] ^= 0x5A
        with pytest.raises(CacheValueError):
            decode_value(bytes(bad), INT8, CHAIN, 1)
    for n in (0, 3, HEADER_BYTES - 1, HEADER_BYTES, len(buf) // 2, len(buf) - 1):
        with pytest.raises(CacheValueError):
            decode_value(buf[:n], INT8, CHAIN, 1)
    with pytest.raises(CacheValueError):
        decode_value(buf + b"\0", INT8, CHAIN, 1)


def test_mismatches_rejected():
    buf = encode_value(make_page(INT8, 2), INT8, CHAIN)
    with pytest.raises(CacheValueError, match="another key"):
        decode_value(buf, INT8, bytes(32), 2)
    with pytest.raises(CacheValueError, match="page"):
        decode_value(buf, INT8, CHAIN, 1)
    with pytest.raises(CacheValueError, match="layout"):
        decode_value(buf, dataclasses.replace(INT8, group_size=8), CHAIN, 2)
    with pytest.raises(CacheValueError, match="magic"):
        decode_value(b"PICKLE" + buf[6:], INT8, CHAIN, 2)


def test_encode_refuses_pages_that_do_not_fit():
    page = make_page(INT8, 0)
    with pytest.raises(CacheValueError, match="full pages"):
        encode_value(dataclasses.replace(page, num_tokens=INT8.page_size - 1), INT8, CHAIN)
    with pytest.raises(CacheValueError):
        encode_value(make_page(DENSE, 0), INT8, CHAIN)
    with pytest.raises(CacheValueError):
        encode_value(page, DENSE, CHAIN)
