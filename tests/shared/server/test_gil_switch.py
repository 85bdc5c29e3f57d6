"""`--gil-switch-ms`: filled from the environment like every service option, applied at service start."""

from __future__ import annotations

import sys

import pytest

from pdserve.config import config_from
from pdserve.server.service_config import ServerOptions


@pytest.fixture
def restore_switch():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_env_sets_the_interval(restore_switch):
    cfg = config_from(ServerOptions, None, "PDSERVE_PREFILL_", {"PDSERVE_PREFILL_GIL_SWITCH_MS": "0.5"})
    assert cfg.gil_switch_ms == 0.5
    assert cfg.server_problems() == []
    assert cfg.apply_gil_switch() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_zero_leaves_pythons_default(restore_switch):
    sys.setswitchinterval(0.005)
    assert ServerOptions().apply_gil_switch() == pytest.approx(0.005)


@pytest.mark.parametrize("ms", [-1.0, 101.0])
def test_out_of_range_is_a_config_problem(ms):
    assert any("--gil-switch-ms" in p for p in ServerOptions(gil_switch_ms=ms).server_problems())
