"""wait_until: returns the condition's first truthy value, raises TimeoutError at the deadline."""

from __future__ import annotations

import threading

import pytest

from pdserve.testing.wait import wait_until


def test_returns_first_truthy_value_once_the_event_happened():
    box: list[int] = []
    threading.Timer(0.05, box.append, (7,)).start()
    assert wait_until(lambda: box[:1], timeout=10) == [7]


def test_times_out_with_the_condition_named():
    calls = []
    with pytest.raises(TimeoutError, match="never"):
        wait_until(lambda: calls.append(1), timeout=0.05, interval=0.01, what="never")
    assert len(calls) >= 2  # polled, then checked once more at the deadline
