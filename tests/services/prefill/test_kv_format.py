"""Prefill's --kv-dtype against the page format each decode asks for: served as asked, logged once per format."""

import logging

import pytest

from pdserve.kv.codec import KVLayoutSpec
from pdserve.prefill.kv_format import ShipFormatCheck, kv_dtype_of


def layout(dtype: str) -> KVLayoutSpec:
    group = {"int8": 16, "fp8": 16}.get(dtype, 0)
    return KVLayoutSpec(dtype, page_size=4, num_layers=2, num_kv_heads=2, head_dim=16, group_size=group)


@pytest.mark.parametrize(
    ("dtype", "flag"), [("int8", "int8"), ("fp8", "fp8"), ("float32", "auto"), ("bfloat16", "auto")]
)
def test_a_layout_names_the_kv_dtype_that_makes_it(dtype, flag):
    assert kv_dtype_of(layout(dtype)) == flag
    assert ShipFormatCheck(flag).mismatch(layout(dtype)) == ""


def test_a_mismatch_is_served_and_logged_once_per_format(caplog):
    check = ShipFormatCheck("int8")
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        reasons = [check.check(layout(d)) for d in ("float32", "float32", "int8", "fp8", "float32")]
    assert reasons[2] == "" and all(reasons[i] for i in (0, 1, 3, 4))
    assert "decode asks for auto KV pages (float32)" in reasons[0] and "--kv-dtype int8" in reasons[0]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [reasons[0], reasons[3]]  # once per requested format


def test_batch_invariant_says_what_it_loses():
    assert "--batch-invariant holds only for auto" in ShipFormatCheck("auto", batch_invariant=True).mismatch(
        layout("int8")
    )
    assert "--batch-invariant" not in ShipFormatCheck("auto").mismatch(layout("int8"))
