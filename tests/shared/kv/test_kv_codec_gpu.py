"""`check_values` on CUDA: a receiver's complete rows are checked without queueing behind the engine's stream
(CUDA only; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pdserve.errors import CorruptPage
from pdserve.kv.codec import check_values

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = torch.device("cuda")


def _busy_current_stream() -> torch.cuda.Event:
    """Queue ~0.5 s of GPU work on the current stream (as an engine step in flight); its end event."""
    torch.cuda._sleep(int(1e9))  # spin cycles: ~0.5 s on a ~2 GHz GPU
    done = torch.cuda.Event()
    done.record()
    return done


def test_complete_rows_do_not_wait_for_the_current_stream():
    data = torch.randint(-127, 128, (64, 1024), dtype=torch.int8, device=DEV)
    scales = torch.rand(64, 16, dtype=torch.float16, device=DEV)
    bad = scales.clone()
    bad[3, 4] = float("nan")
    check_values(data, scales, None, complete=True)  # first use: lazy module loading synchronizes the context
    with pytest.raises(CorruptPage):
        check_values(data, bad, None, complete=True)
    torch.cuda.synchronize()
    busy = _busy_current_stream()
    check_values(data, scales, None, complete=True)
    assert not busy.query(), "the check waited for the work on the current stream"
    torch.cuda.synchronize()
    busy = _busy_current_stream()
    with pytest.raises(CorruptPage):
        check_values(data, bad, None, complete=True)
    assert not busy.query()
    torch.cuda.synchronize()


def test_default_waits_for_work_queued_on_the_current_stream():
    scales = torch.empty(64, 16, dtype=torch.float16, device=DEV)
    torch.cuda.synchronize()
    busy = _busy_current_stream()
    scales.fill_(float("inf"))  # queued behind the busy work: the check must see it
    with pytest.raises(CorruptPage):
        check_values(torch.zeros(64, 8, dtype=torch.int8, device=DEV), scales, None)
    assert busy.query()
