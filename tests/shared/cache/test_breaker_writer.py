"""Circuit breaker states and the bounded write-back queue."""

from __future__ import annotations

import threading

import pytest

from pdserve.cache.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from pdserve.cache.writer import WriteBack


def test_breaker_opens_probes_and_closes():
    now = [0.0]
    b = CircuitBreaker(failures=2, cooldown_s=5.0, clock=lambda: now[0])
    b.failure()
    assert b.state == CLOSED and b.allow()
    b.success()
    b.failure()
    assert b.state == CLOSED  # a success in between resets the count
    b.failure()
    assert b.state == OPEN and not b.allow()
    now[0] = 4.9
    assert not b.allow()
    now[0] = 5.0
    assert b.allow() and b.state == HALF_OPEN
    assert not b.allow()  # one probe at a time
    b.failure()
    assert b.state == OPEN and not b.allow() and b.times_opened == 2
    now[0] = 10.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow() and b.allow()
    with pytest.raises(ValueError):
        CircuitBreaker(failures=0)


def test_writeback_batches_drops_when_full_and_flushes():
    gate = threading.Event()
    seen: list[list[int]] = []

    def handle(batch):
        gate.wait(10)
        seen.append(batch)

    w = WriteBack(handle, max_queue=3, max_batch=2)
    assert w.submit(0)  # taken by the thread at once, which then blocks on the gate
    while len(w):
        pass
    accepted = [w.submit(i) for i in range(1, 6)]
    assert accepted == [True, True, True, False, False]  # bounded: never blocks the caller
    assert not w.flush(timeout=0.05)
    gate.set()
    assert w.flush(timeout=5)
    assert [x for b in seen for x in b] == [0, 1, 2, 3] and max(len(b) for b in seen) <= 2
    w.close()
    assert not w.submit(9)


def test_writeback_survives_a_failing_batch():
    calls = []

    def handle(batch):
        calls.append(batch)
        if batch == [1]:
            raise RuntimeError("boom")

    w = WriteBack(handle, max_queue=10, max_batch=1)
    w.submit(1)
    assert w.flush(5)
    w.submit(2)
    assert w.flush(5)
    assert calls == [[1], [2]]
    w.close()
