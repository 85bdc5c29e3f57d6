"""The engine processes' GIL switch interval: set in microseconds, 0 leaves CPython's, negative refused."""

import sys

import pytest

from pdserve.server.gil import PYTHON_DEFAULT_US, set_switch_interval


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_set_switch_interval(restore_interval):
    assert set_switch_interval(200) == pytest.approx(200)
    assert sys.getswitchinterval() == pytest.approx(200e-6)
    assert set_switch_interval(0) == pytest.approx(200)  # 0: left as it is
    with pytest.raises(ValueError, match=">= 0"):
        set_switch_interval(-1)


def test_python_default_is_what_the_interpreter_starts_with():
    import subprocess

    out = subprocess.run([sys.executable, "-c", "import sys; print(sys.getswitchinterval())"], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert float(out.stdout) * 1e6 == pytest.approx(PYTHON_DEFAULT_US)
