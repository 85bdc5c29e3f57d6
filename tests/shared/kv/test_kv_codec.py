"""pdserve.kv.codec: the layout's proto round trip and validation (a layout that does not fit raises InvalidRequest,
never CorruptPage: no bytes were damaged), and the value checks every KV path shares: values attention cannot use
raise CorruptPage through the prompt-cache value form and `check_values` / `check_scales` (the batch receivers).
(Batches on the wire: tests/shared/kv/transfer/test_wire.py.)"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from pdserve.cache.keys import CacheNamespace
from pdserve.cache.value import decode_value, encode_value
from pdserve.errors import CorruptPage, InvalidRequest
from pdserve.kv.codec import KVLayoutSpec, check_scales, check_values
from pdserve.kv.payload import PagePayload, quantize_payload
from pdserve.v1 import kv_pb2

FP = "sha256:model-a"


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


@contextlib.contextmanager
def raises_invalid(match: str | None = None):
    """InvalidRequest, and not its subclass CorruptPage (a caller's mistake, not damaged bytes)."""
    with pytest.raises(InvalidRequest, match=match) as info:
        yield
    assert not isinstance(info.value, CorruptPage), info.value


def test_layout_proto_roundtrip():
    for lay in (layout(), layout("int8", True, 64), layout("bfloat16")):
        assert KVLayoutSpec.from_proto(lay.to_proto()) == lay
    with pytest.raises(InvalidRequest):
        KVLayoutSpec.from_proto(kv_pb2.KVLayout(format_version=1, dtype=kv_pb2.KV_DTYPE_UNSPECIFIED))


def test_layout_that_does_not_fit_is_invalid():
    layout("int8").validate()
    with raises_invalid("does not divide"):
        layout("int8", group_size=48).validate()  # does not divide head_dim
    with raises_invalid("group_size 0"):
        dataclasses.replace(layout("bfloat16"), group_size=16).validate()
    with raises_invalid("format_version"):
        dataclasses.replace(layout(), format_version=2).validate()


def full_page(p: PagePayload, lay: KVLayoutSpec) -> PagePayload:
    """`p` placed inside a full page of all layers (what the prompt cache stores), its values included."""

    def full(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        out = torch.zeros(2, lay.num_layers, lay.page_size, *t.shape[3:], dtype=t.dtype)
        out[:, p.layer_start : p.layer_start + p.layer_count, : p.num_tokens] = t
        return out

    return PagePayload(p.page_index, lay.page_size, 0, full(p.data), full(p.scales), full(p.zeros), p.group_size)


def cache_round_trip(page: PagePayload, lay: KVLayoutSpec) -> PagePayload:
    ns, chain = CacheNamespace(FP, lay), bytes(32)
    return decode_value(encode_value(page, ns, chain), ns, chain, page.page_index)


def refused_everywhere(p: PagePayload, lay: KVLayoutSpec, match: str) -> None:
    """A faithfully checksummed page `p` is CorruptPage as a prompt-cache value and by `check_values` (the KV
    receivers' batch check)."""
    with pytest.raises(CorruptPage, match=match):
        cache_round_trip(full_page(p, lay), lay)
    with pytest.raises(CorruptPage, match=match):
        check_values(p.data, p.scales, p.zeros)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["scales", "zeros"])
def test_non_finite_scales_with_a_valid_checksum_raise(bad, where):
    """A sender can checksum garbage: NaN / inf scales or zero points are refused (CorruptPage → DATA_LOSS), through
    the bytes form (the prompt cache) and by `check_scales` (the KV receivers' batch check)."""
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
    non-finite scales: through the bytes form and by `check_values` (the receivers' batch check).
    int8 data has no such values; the largest fp8 values (0x7E / 0xFE, +-448) are values."""
    lay = layout(dtype)
    p = payload(lay)
    _poison(p, how)
    refused_everywhere(p, lay, "NaN")
    good = payload(lay)
    if dtype == "fp8":
        good.data.view(torch.uint8)[0, 0, 0, 0, :2] = torch.tensor([0x7E, 0xFE], dtype=torch.uint8)
    check_values(good.data, good.scales, good.zeros)
    page = full_page(good, lay)
    assert cache_round_trip(page, lay).data.view(torch.uint8).equal(page.data.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_host_check_agrees_with_torch_on_every_bit_pattern(dtype):
    """On CPU the check reads exponent bits in numpy (no OpenMP fan-out): for every fp8 byte, every 16-bit pattern
    whose exponent is all ones (fp16, bf16: infinities and NaNs) plus a spread of the others, and float32's
    specials, on strided views as the batch rows give, it refuses exactly what torch's own test refuses."""
    width = torch.finfo(dtype).bits
    if width == 8:
        values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    elif width == 16:
        top = 0x7C00 if dtype == torch.float16 else 0x7F80  # the exponent bits
        patterns = [p for p in range(2**16) if p % 61 == 0 or p & top == top]
        values = torch.tensor(patterns, dtype=torch.int32).to(torch.uint16).view(torch.int16).view(dtype)
    else:
        values = torch.tensor([0.0, -0.0, 1.5, 3.4e38, 1e-45, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    for v in values.split(1):
        if dtype == torch.float8_e4m3fn:
            usable = int(v.view(torch.uint8)) & 0x7F != 0x7F
        else:
            usable = bool(torch.isfinite(v).all())
        rows = torch.ones(3, 8, dtype=dtype)
        rows[1, 4] = v  # a strided view: every other column, as scales are a column range of the batch rows
        strided = rows[:, ::2]
        try:
            check_scales(strided, None) if dtype.itemsize > 1 else check_values(strided, None, None)
            refused = False
        except CorruptPage:
            refused = True
        assert refused == (not usable), (dtype, v)


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
