"""KVPage codec: exact round trips; every kind of corruption or mismatch on decode raises CorruptPage, a payload
or layout that does not fit raises InvalidRequest (never CorruptPage: the bytes were never damaged)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.value import decode_value, encode_value
from pdserve.errors import CorruptPage, InvalidRequest
from pdserve.kv.codec import (
    KVLayoutSpec,
    check_scales,
    check_values,
    checksum,
    decode_page,
    encode_page,
)
from pdserve.kv.payload import PagePayload, quantize_payload
from pdserve.v1 import kv_pb2

FP = "sha256:model-a"
RID = "req-1"


def layout(dtype: str = "int8", asymmetric: bool = False, group_size: int = 32) -> KVLayoutSpec:
    return KVLayoutSpec(
        dtype=dtype,
        page_size=16,
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        group_size=group_size if dtype in ("int8", "fp8") else 0,
        asymmetric=asymmetric,
    )


def payload(lay: KVLayoutSpec, num_tokens: int = 11, layer_start: int = 1, layers: int = 3) -> PagePayload:
    g = torch.Generator().manual_seed(1)
    dense = PagePayload(
        page_index=7,
        num_tokens=num_tokens,
        layer_start=layer_start,
        scales=None,
        zeros=None,
        data=torch.randn(2, layers, num_tokens, lay.num_kv_heads, lay.head_dim, generator=g) * 3,
    )
    if lay.quantized:
        return quantize_payload(dense, lay.group_size, lay.asymmetric, lay.torch_dtype)
    dense.data = dense.data.to(lay.torch_dtype)
    return dense


def encode(p: PagePayload, lay: KVLayoutSpec, **kw) -> kv_pb2.KVPage:
    args = dict(request_id=RID, seq_no=3, layout=lay, fingerprint=FP) | kw
    return encode_page(p, **args)


def decode(msg: kv_pb2.KVPage, lay: KVLayoutSpec, **kw) -> PagePayload:
    args = dict(expected_layout=lay, expected_fingerprint=FP, expected_request_id=RID) | kw
    return decode_page(msg, **args)


@contextlib.contextmanager
def raises_invalid(match: str | None = None):
    """InvalidRequest, and not its subclass CorruptPage (a caller's mistake, not damaged bytes)."""
    with pytest.raises(InvalidRequest, match=match) as info:
        yield
    assert not isinstance(info.value, CorruptPage), info.value


def wire(msg: kv_pb2.KVPage) -> kv_pb2.KVPage:
    """Through real protobuf bytes, as gRPC would."""
    return kv_pb2.KVPage.FromString(msg.SerializeToString())


@pytest.mark.parametrize(
    "dtype,asym",
    [("int8", False), ("int8", True), ("fp8", False), ("float32", False), ("bfloat16", False), ("float16", False)],
)
def test_roundtrip_exact(dtype, asym):
    lay = layout(dtype, asym)
    p = payload(lay)
    msg = wire(encode(p, lay))
    assert msg.layer_count == 3 and msg.seq_no == 3 and msg.checksum == checksum(msg)
    out = decode(msg, lay)
    assert (out.page_index, out.num_tokens, out.layer_start, out.group_size) == (
        p.page_index,
        p.num_tokens,
        p.layer_start,
        p.group_size,
    )
    assert out.data.dtype == p.data.dtype and torch.equal(out.data.view(torch.uint8), p.data.view(torch.uint8))
    for a, b in ((out.scales, p.scales), (out.zeros, p.zeros)):
        assert (a is None and b is None) or torch.equal(a, b)
    assert out.nbytes == p.nbytes == len(msg.data) + len(msg.scales) + len(msg.zero_points)
    out.data.view(torch.uint8).add_(1)  # own, writable memory


def test_layout_proto_roundtrip():
    for lay in (layout(), layout("int8", True, 64), layout("bfloat16")):
        assert KVLayoutSpec.from_proto(lay.to_proto()) == lay
    with pytest.raises(InvalidRequest):
        KVLayoutSpec.from_proto(kv_pb2.KVLayout(format_version=1, dtype=kv_pb2.KV_DTYPE_UNSPECIFIED))


def corrupt(name: str, msg: kv_pb2.KVPage) -> None:
    """Apply one corruption in place."""
    if name == "flip_data_byte":
        b = bytearray(msg.data)
        b[len(b) // 2] ^= 0x01
        msg.data = bytes(b)
    elif name == "flip_scale_byte":
        b = bytearray(msg.scales)
        b[3] ^= 0x80
        msg.scales = bytes(b)
    elif name == "flip_zero_byte":
        b = bytearray(msg.zero_points)
        b[0] ^= 0x04
        msg.zero_points = bytes(b)
    elif name == "truncated_scales":
        msg.scales = msg.scales[:-2]
    elif name == "truncated_data":
        msg.data = msg.data[:-1]
    elif name == "extra_data":
        msg.data = msg.data + b"\x00"
    elif name == "missing_zero_points":
        msg.zero_points = b""
    elif name == "header_page_index":  # header field changed, checksum not updated
        msg.page_index += 1
    elif name == "header_seq_no":
        msg.seq_no += 1
    elif name == "checksum":
        msg.checksum ^= 1
    elif name == "format_version":
        msg.layout.format_version = 2
    elif name == "no_layout":
        msg.ClearField("layout")
    else:
        raise AssertionError(name)


@pytest.mark.parametrize(
    "name",
    [
        "flip_data_byte",
        "flip_scale_byte",
        "flip_zero_byte",
        "truncated_scales",
        "truncated_data",
        "extra_data",
        "missing_zero_points",
        "header_page_index",
        "header_seq_no",
        "checksum",
        "format_version",
        "no_layout",
    ],
)
def test_corruption_raises(name):
    lay = layout("int8", asymmetric=True)
    msg = wire(encode(payload(lay), lay))
    decode(msg, lay)  # sane before
    corrupt(name, msg)
    with pytest.raises(CorruptPage):
        decode(wire(msg), lay)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flipped_byte_dense_raises(dtype):
    lay = layout(dtype)
    msg = encode(payload(lay), lay)
    b = bytearray(msg.data)
    b[-1] ^= 0x10
    msg.data = bytes(b)
    with pytest.raises(CorruptPage, match="checksum"):
        decode(msg, lay)


def test_wrong_fingerprint_request_and_layout_raise():
    lay = layout()
    msg = encode(payload(lay), lay)
    with pytest.raises(CorruptPage, match="fingerprint"):
        decode(msg, lay, expected_fingerprint="sha256:model-b")
    with pytest.raises(CorruptPage, match="request id"):
        decode(msg, lay, expected_request_id="req-2")
    for other in (
        dataclasses.replace(lay, group_size=64),
        dataclasses.replace(lay, asymmetric=True),
        dataclasses.replace(lay, page_size=32),
        dataclasses.replace(lay, num_layers=8),
        dataclasses.replace(lay, num_kv_heads=4),
        layout("float32"),
    ):
        with pytest.raises(CorruptPage, match="layout"):
            decode(msg, other)


def resign(msg: kv_pb2.KVPage) -> kv_pb2.KVPage:
    """A well-formed (correct checksum) but semantically invalid page, as a buggy sender would produce."""
    msg.checksum = checksum(msg)
    return msg


def test_num_tokens_over_page_size_raises_even_with_valid_checksum():
    lay = layout("float32")
    big = dataclasses.replace(lay, page_size=32)
    msg = encode(payload(big, num_tokens=20), big)  # bytes sized for 20 tokens
    msg.layout.CopyFrom(lay.to_proto())
    resign(msg)
    with pytest.raises(CorruptPage, match="num_tokens"):
        decode(msg, lay)
    with raises_invalid(match="num_tokens"):
        encode(payload(big, num_tokens=20), lay)


def test_zero_tokens_and_layer_range_outside_model_raise():
    lay = layout()
    msg = encode(payload(lay, layer_start=1, layers=3), lay)
    msg.layer_start = 2  # layers [2, 5) of a 4-layer model
    with pytest.raises(CorruptPage, match="layer range"):
        decode(resign(msg), lay)
    msg = encode(payload(lay), lay)
    msg.num_tokens, msg.data, msg.scales = 0, b"", b""
    with pytest.raises(CorruptPage, match="num_tokens"):
        decode(resign(msg), lay)
    with raises_invalid(match="layer range"):
        encode(payload(lay, layer_start=2, layers=3), lay)


def test_resigned_size_mismatch_raises():
    lay = layout("int8", asymmetric=False)
    msg = encode(payload(lay), lay)
    msg.zero_points = b"\x00" * len(msg.scales)  # zero points on a symmetric page
    with pytest.raises(CorruptPage, match="zero_points"):
        decode(resign(msg), lay)


def test_encode_rejects_payload_not_matching_layout():
    lay = layout("int8", asymmetric=False)
    p = payload(lay)
    with raises_invalid():
        encode(p, dataclasses.replace(lay, group_size=16))
    with raises_invalid():
        encode(p, dataclasses.replace(lay, asymmetric=True))
    with raises_invalid():
        encode(p, layout("bfloat16"))
    with raises_invalid():
        encode(payload(layout("float32")), layout("bfloat16"))
    with raises_invalid():
        encode(p, dataclasses.replace(lay, group_size=48))  # does not divide head_dim


def refused_everywhere(p: PagePayload, lay: KVLayoutSpec, match: str) -> None:
    """A faithfully checksummed page `p` is CorruptPage on the wire, as a prompt-cache value and by
    `check_values` (the KV receivers' batch check)."""
    with pytest.raises(CorruptPage, match=match):
        decode(wire(encode(p, lay)), lay)

    # the prompt cache stores full pages of all layers: `p` placed inside one, its bad value included
    def full(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        out = torch.zeros(2, lay.num_layers, lay.page_size, *t.shape[3:], dtype=t.dtype)
        out[:, p.layer_start : p.layer_start + p.layer_count, : p.num_tokens] = t
        return out

    page = PagePayload(p.page_index, lay.page_size, 0, full(p.data), full(p.scales), full(p.zeros), p.group_size)
    ns, chain = CacheNamespace(FP, lay), bytes(32)
    with pytest.raises(CorruptPage, match=match):
        decode_value(encode_value(page, ns, chain), ns, chain, p.page_index)
    with pytest.raises(CorruptPage, match=match):
        check_values(p.data, p.scales, p.zeros)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["scales", "zeros"])
def test_non_finite_scales_with_a_valid_checksum_raise(bad, where):
    """A sender can checksum garbage: NaN / inf scales or zero points are refused (CorruptPage → DATA_LOSS), on a
    single page, through the bytes form (the prompt cache) and by `check_scales` (the KV receivers' batch check)."""
    lay = layout("int8", asymmetric=True)
    p = payload(lay)
    t = p.scales if where == "scales" else p.zeros
    assert t is not None
    t[1, 0, 5, 1, 0] = bad  # one value of one group, V of the second layer
    refused_everywhere(p, lay, "NaN or infinity")
    with pytest.raises(CorruptPage, match="NaN or infinity"):
        check_scales(p.scales, p.zeros)
    good = payload(lay)
    check_scales(good.scales, good.zeros)  # finite: passes, also with no zero points
    check_scales(good.scales, None)


def _poison(p: PagePayload, how: str) -> None:
    """One value of V of the second layer made unusable: NaN / inf for float data, a NaN byte for fp8."""
    if p.data.dtype == torch.float8_e4m3fn:
        p.data.view(torch.uint8)[1, 0, 5, 1, 3] = {"nan": 0x7F, "-nan": 0xFF}[how]
    else:
        p.data[1, 0, 5, 1, 3] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[how]


@pytest.mark.parametrize(
    "dtype, how",
    [("float32", "nan"), ("float32", "inf"), ("bfloat16", "-inf"), ("float16", "nan"), ("fp8", "nan"), ("fp8", "-nan")],
)
def test_unusable_data_with_a_valid_checksum_raises(dtype, how):
    """Dense pages with NaN / inf values and fp8 pages with a NaN encoding (e4m3 has no infinity) are refused like
    non-finite scales: on a single page, through the bytes form and by `check_values` (the receivers' batch check).
    int8 data has no such values; the largest fp8 values (0x7E / 0xFE, +-448) are values."""
    lay = layout(dtype)
    p = payload(lay)
    _poison(p, how)
    refused_everywhere(p, lay, "NaN")
    good = payload(lay)
    if dtype == "fp8":
        good.data.view(torch.uint8)[0, 0, 0, 0, :2] = torch.tensor([0x7E, 0xFE], dtype=torch.uint8)
    check_values(good.data, good.scales, good.zeros)
    assert decode(wire(encode(good, lay)), lay).data.view(torch.uint8).equal(good.data.view(torch.uint8))


def test_int8_data_is_never_refused_for_its_values():
    lay = layout("int8")
    p = payload(lay)
    p.data.view(torch.uint8)[1, 0, 5, 1, :3] = torch.tensor([0x7F, 0xFF, 0x80], dtype=torch.uint8)
    check_values(p.data, p.scales, p.zeros)


def test_fp8_layout_is_symmetric_only_and_on_the_wire():
    lay = layout("fp8")
    assert lay.quantized and lay.to_proto().dtype == kv_pb2.KV_DTYPE_FP8_E4M3
    assert KVLayoutSpec.from_proto(lay.to_proto()) == lay
    with raises_invalid("symmetric"):
        dataclasses.replace(lay, asymmetric=True).validate()
    with raises_invalid("group_size"):
        dataclasses.replace(lay, group_size=0).validate()
    with raises_invalid():  # an int8 payload is not an fp8 page
        encode(payload(layout("int8")), lay)
