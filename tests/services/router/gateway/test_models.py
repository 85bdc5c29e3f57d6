"""The gateway's model names: the router's served models (ListModels), and `--model-name` as an alias of the
router's model while it serves exactly one (or has no ListModels)."""

from __future__ import annotations

import pytest

from pdserve.router.gateway.errors import APIError
from pdserve.router.gateway.models import forward_name, listed


def test_listed():
    assert listed(["alpha", "beta"], "pdserve") == ["alpha", "beta"]
    assert listed(["alpha"], "pdserve") == ["pdserve"]  # one model: the gateway's name for it, as always
    assert listed(None, "pdserve") == ["pdserve"]  # a router without ListModels


def test_forward_name():
    assert forward_name("beta", ["alpha", "beta"], "pdserve") == "beta"
    assert forward_name("alpha", ["alpha"], "pdserve") == "alpha"
    assert forward_name("pdserve", ["alpha"], "pdserve") == ""  # the alias: the router's only model
    assert forward_name("pdserve", None, "pdserve") == ""


@pytest.mark.parametrize(
    "requested, names", [("gamma", ["alpha", "beta"]), ("pdserve", ["alpha", "beta"]), ("other", None)]
)
def test_an_unknown_model_is_404_naming_the_served_ones(requested, names):
    with pytest.raises(APIError) as e:
        forward_name(requested, names, "pdserve")
    assert e.value.status == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    assert repr(requested) in str(e.value) and all(repr(n) in str(e.value) for n in names or ["pdserve"])
