"""`HeadStarts`, the registry of the router's head starts, without an engine: admission outcomes, keys, the limit,
expiry (also while the engine's admission is still queued) and shutdown. Each admitted start is dropped exactly once
unless its stream took it; a refused one never (its id may be another request's)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import cast

import pytest

from pdserve.prefill.head_start import EXPIRED, TAKEN, WAITING, DecodeShape, HeadStart, HeadStarts
from pdserve.prefill.prefill_call import PrefillCall
from pdserve.testing.wait import wait_until


def make(rid: str, key: bytes = b"k" * 16, wait_s: float = 60.0) -> HeadStart:
    # the fields a stream compares are not the registry's business: placeholders
    return HeadStart(rid, key, [1], b"", "", cast("DecodeShape", None), time.monotonic() + wait_s)


def start_in(reg: HeadStarts, start: HeadStart, submit) -> str:
    """`reserve` then `admit` (with a placeholder call), as prefill's Start does."""
    why = reg.reserve(start)
    if not why:
        reg.admit(start, cast("PrefillCall", object()), submit)
    return why


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
    assert start_in(reg, start, admitted) == "" and start.state == WAITING and start.admitted.result() is True
    assert reg.take("a", b"x" * 16) is None  # another key
    assert reg.take("a", b"k" * 16) is start and start.state == TAKEN
    assert reg.take("a", b"k" * 16) is None  # once
    assert (reg.started, reg.taken, reg.waiting) == (1, 1, 0)
    reg.close()
    assert dropped == []


def test_limit_and_duplicate_ids_are_refused(registry):
    reg, _ = registry
    assert start_in(reg, make("a"), admitted) == ""
    assert "here already" in start_in(reg, make("a"), admitted)
    assert start_in(reg, make("b"), admitted) == ""
    assert "already wait" in start_in(reg, make("c"), admitted)
    assert reg.refused == 2 and reg.waiting == 2


def test_unclaimed_start_expires_and_is_dropped_once(registry):
    reg, dropped = registry
    start = make("a", wait_s=0.05)
    assert start_in(reg, start, admitted) == ""
    wait_until(lambda: dropped == ["a"], what="the expired start dropped")
    assert start.state == EXPIRED and reg.expired == 1 and reg.take("a", b"k" * 16) is None
    time.sleep(0.1)
    assert dropped == ["a"]


def test_no_expiry_while_the_admission_is_queued_then_dropped_once_admitted(registry):
    """A stream may still wait for a start whose admission is queued: it expires only once the engine has it."""
    reg, dropped = registry
    pending: Future = Future()
    start = make("a", wait_s=0.01)
    assert start_in(reg, start, lambda: pending) == ""
    time.sleep(0.1)
    assert reg.expired == 0 and dropped == []
    pending.set_result(None)
    wait_until(lambda: dropped == ["a"], what="the admitted, overdue start dropped")
    assert start.state == EXPIRED and start.admitted.result() is True


def test_refused_admission_is_never_dropped(registry):
    reg, dropped = registry
    pending: Future = Future()
    start = make("a", wait_s=0.01)
    assert start_in(reg, start, lambda: pending) == ""
    pending.set_exception(ValueError("duplicate request id"))
    time.sleep(0.1)
    assert dropped == [] and isinstance(start.admitted.exception(), ValueError) and reg.refused == 1
    assert reg.take("a", b"k" * 16) is None and reg.waiting == 0  # gone from the registry, nothing to take
    cancelled: Future = Future()
    stopped = make("b")
    assert start_in(reg, stopped, lambda: cancelled) == ""
    cancelled.cancel()  # the engine loop stopped before it
    assert stopped.admitted.exception() is not None and reg.waiting == 0 and dropped == []


def test_a_start_after_its_stream_is_refused(registry):
    """Start and stream come by different hops: a stream that found no start keeps a Start of its id out (both
    would admit the id), for wait_s."""
    reg, _ = registry
    assert reg.take("late", b"k" * 16) is None
    why = start_in(reg, make("late"), admitted)
    assert "came first" in why and reg.waiting == 0
    reg.wait_s = 0.01
    assert reg.take("later", b"k" * 16) is None
    wait_until(lambda: start_in(reg, make("later"), admitted) == "", what="the stream's mark lapsed")


def test_a_taken_start_that_differs_is_dropped_if_admitted(registry):
    reg, dropped = registry
    start = make("a")
    start_in(reg, start, admitted)
    assert reg.take("a", b"k" * 16) is start
    reg.mismatch(start, "decode's prompt differs")
    assert dropped == ["a"] and (reg.taken, reg.mismatched) == (0, 1)


def test_close_drops_every_waiting_start(registry):
    reg, dropped = registry
    start_in(reg, make("a"), admitted)
    start_in(reg, make("b"), admitted)
    reg.close()
    assert sorted(dropped) == ["a", "b"]
    assert "shutting down" in start_in(reg, make("c"), admitted)


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


def test_a_stream_waits_for_a_start_reserved_before_its_lookup(registry):
    """Prefill's Start reserves the id before its lookup: a stream arriving meanwhile takes the start and waits for
    its admission (it never computes the request beside it); one made impossible is abandoned, not dropped."""
    reg, dropped = registry
    start = make("a")
    assert reg.reserve(start) == ""
    assert reg.take("a", b"k" * 16) is start and not start.admitted.done()
    reg.admit(start, cast("PrefillCall", object()), admitted)
    assert start.admitted.result() is True
    other = make("b")
    assert reg.reserve(other) == ""
    reg.abandon(other, ValueError("empty prompt"))
    assert isinstance(other.admitted.exception(), ValueError) and reg.waiting == 0 and dropped == []
