"""`HeadStarts`, the registry of the router's head starts, without an engine: admission outcomes, keys, the limit,
expiry (also while the engine's admission is still queued) and shutdown. Each admitted start is dropped exactly once
unless its stream took it; a refused one never (its id may be another request's)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import cast

import pytest

from pdserve.prefill.head_start import EXPIRED, TAKEN, WAITING, HeadStart, HeadStarts
from pdserve.testing.wait import wait_until


def make(rid: str, key: bytes = b"k" * 16, wait_s: float = 60.0) -> HeadStart:
    # the fields a stream compares are not the registry's business: placeholders
    return HeadStart(rid, key, [1], b"", "", cast("object", None), cast("object", None), cast("object", None),  # type: ignore[arg-type]
                     time.monotonic() + wait_s)  # fmt: skip


@pytest.fixture
def registry():
    dropped: list[str] = []
    lock = threading.Lock()

    def drop(start: HeadStart) -> None:
        with lock:
            dropped.append(start.request_id)

    reg = HeadStarts(wait_s=60.0, limit=2, drop=drop)
    yield reg, dropped
    reg.close()


def admitted() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


def test_taken_by_its_key_only_and_never_dropped(registry):
    reg, dropped = registry
    start = make("a")
    assert reg.admit(start, admitted) == "" and start.state == WAITING and start.admitted.result() is True
    assert reg.take("a", b"x" * 16) is None  # another key
    assert reg.take("a", b"k" * 16) is start and start.state == TAKEN
    assert reg.take("a", b"k" * 16) is None  # once
    assert (reg.started, reg.taken, reg.waiting) == (1, 1, 0)
    reg.close()
    assert dropped == []


def test_limit_and_duplicate_ids_are_refused(registry):
    reg, _ = registry
    assert reg.admit(make("a"), admitted) == ""
    assert "here already" in reg.admit(make("a"), admitted)
    assert reg.admit(make("b"), admitted) == ""
    assert "already wait" in reg.admit(make("c"), admitted)
    assert reg.refused == 2 and reg.waiting == 2


def test_unclaimed_start_expires_and_is_dropped_once(registry):
    reg, dropped = registry
    start = make("a", wait_s=0.05)
    assert reg.admit(start, admitted) == ""
    wait_until(lambda: dropped == ["a"], what="the expired start dropped")
    assert start.state == EXPIRED and reg.expired == 1 and reg.take("a", b"k" * 16) is None
    time.sleep(0.1)
    assert dropped == ["a"]


def test_expiry_during_admission_drops_after_the_engine_took_it(registry):
    """The engine's admission still queued when the time runs out: dropped once admitted, not before (its id was
    not yet this start's in the engine)."""
    reg, dropped = registry
    pending: Future = Future()
    start = make("a", wait_s=0.05)
    assert reg.admit(start, lambda: pending) == ""
    wait_until(lambda: reg.expired == 1, what="the start expired")
    assert dropped == []
    pending.set_result(None)
    assert dropped == ["a"] and start.admitted.result() is True


def test_refused_admission_is_never_dropped(registry):
    reg, dropped = registry
    pending: Future = Future()
    start = make("a", wait_s=0.05)
    assert reg.admit(start, lambda: pending) == ""
    wait_until(lambda: reg.expired == 1, what="the start expired")
    pending.set_exception(ValueError("duplicate request id"))
    time.sleep(0.1)
    assert dropped == [] and isinstance(start.admitted.exception(), ValueError) and reg.refused == 1
    late: Future = Future()
    second = make("b")
    assert reg.admit(second, lambda: late) == ""
    late.set_exception(ValueError("prompt too long"))
    assert reg.take("b", b"k" * 16) is None and reg.waiting == 0  # gone from the registry, nothing to take


def test_a_taken_start_that_differs_is_dropped_if_admitted(registry):
    reg, dropped = registry
    start = make("a")
    reg.admit(start, admitted)
    assert reg.take("a", b"k" * 16) is start
    reg.mismatch(start, "decode's prompt differs")
    assert dropped == ["a"] and (reg.taken, reg.mismatched) == (0, 1)


def test_close_drops_every_waiting_start(registry):
    reg, dropped = registry
    reg.admit(make("a"), admitted)
    reg.admit(make("b"), admitted)
    reg.close()
    assert sorted(dropped) == ["a", "b"]
    assert "shutting down" in reg.admit(make("c"), admitted)


def test_a_start_serves_streams_of_the_same_layout_and_groups_whatever_the_transport_without_a_cached_prefix():
    from pdserve.kv.codec import KVLayoutSpec
    from pdserve.prefill.head_start import DecodeShape

    int8 = KVLayoutSpec("int8", 16, 2, 2, 64, 64)
    ipc = DecodeShape(int8, 0, True)
    assert ipc.serves(DecodeShape(int8, 0, False), cached_prefix=False)
    assert not ipc.serves(DecodeShape(int8, 0, False), cached_prefix=True)  # its cached pages ship from the device
    assert ipc.serves(DecodeShape(int8, 0, True), cached_prefix=True)
    assert not ipc.serves(DecodeShape(int8, 4, True), cached_prefix=False)
    assert not ipc.serves(DecodeShape(KVLayoutSpec("bfloat16", 16, 2, 2, 64), 0, True), cached_prefix=False)
