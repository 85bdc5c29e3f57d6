"""Page states of the KV transfer drive freeing: the sender frees once, when every page is acked or on abandon;
the receiver frees its reserved pages once on failure, never after completion. Protocol violations raise."""

import pytest

from pdserve.kv.transfer import PageState, ReceiverPages, SenderPages, TransferError


def test_sender_frees_once_when_all_acked():
    freed = []
    s = SenderPages("r", 3, free=lambda: freed.append(1))
    assert s.states == [PageState.FILLING] * 3
    assert s.ship([0, 1], 20) == 0 and s.ship([2], 10) == 2
    assert s.bytes_shipped == 30 and not s.all_acked()
    assert s.ack(0) is False
    assert s.states == [PageState.ACKED, PageState.SHIPPED, PageState.SHIPPED] and not freed
    assert s.ack(2) is True and freed == [1]
    assert s.states == [PageState.FREED] * 3
    assert s.abandon() is False and freed == [1]  # the RPC's end after all acks frees nothing again


def test_sender_abandon_frees_unacked_pages_once():
    freed = []
    s = SenderPages("r", 2, free=lambda: freed.append(1))
    s.ship([0], 10)
    assert s.abandon() is True and s.abandon() is False and freed == [1]
    assert s.freed


def test_sender_rejects_protocol_errors():
    s = SenderPages("r", 2)
    s.ship([0], 10)
    with pytest.raises(TransferError):
        s.ship([0], 10)  # twice
    with pytest.raises(TransferError):
        s.ship([5], 10)  # not a page of the request
    with pytest.raises(TransferError):
        s.ack(3)  # never shipped


def test_receiver_checks_order_and_completeness():
    freed = []
    r = ReceiverPages("r", 3, free=lambda: freed.append(1))
    r.check(0, [0, 1])
    assert r.filled([0, 1], 20) == 1
    with pytest.raises(TransferError):
        r.check(0, [2])  # repeat of seq 0
    with pytest.raises(TransferError):
        r.check(3, [2])  # gap
    with pytest.raises(TransferError):
        r.check(2, [1])  # page received twice
    with pytest.raises(TransferError):
        r.check(2, [2, 2])  # twice in one batch
    with pytest.raises(TransferError):
        r.check(2, [7])
    with pytest.raises(TransferError):
        r.complete(2)  # page 2 missing
    r.check(2, [2])
    r.filled([2], 10)
    r.complete(3)
    assert r.fail() is False and not freed  # completed: the engine's sequence owns the pages now


def test_receiver_fail_frees_reserved_pages_once():
    freed = []
    r = ReceiverPages("r", 2, free=lambda: freed.append(1))
    r.check(0, [0])
    r.filled([0], 10)
    assert r.fail() is True and r.fail() is False and freed == [1]
    assert r.states == [PageState.FREED] * 2
