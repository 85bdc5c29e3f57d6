"""Page state machines of the KV transfer: every protocol violation is an error, never silent."""

import pytest

from pdserve.kv.transfer import PageState, ReceiverPages, SenderPages, TransferError


def test_sender_lifecycle_and_cumulative_ack():
    s = SenderPages("r", 3)
    assert s.states == [PageState.FILLING] * 3
    assert [s.ship(i, 10) for i in (0, 1, 2)] == [0, 1, 2]
    assert s.bytes_shipped == 30 and not s.all_acked()
    s.ack(1)
    assert s.states == [PageState.ACKED, PageState.ACKED, PageState.SHIPPED]
    s.ack(2)
    assert s.all_acked()
    s.free()
    assert s.states == [PageState.FREED] * 3


def test_sender_rejects_double_ship_and_unknown_ack():
    s = SenderPages("r", 2)
    s.ship(0, 1)
    with pytest.raises(TransferError):
        s.ship(0, 1)
    with pytest.raises(TransferError):
        s.ack(1)


def test_receiver_detects_gap_repeat_range_and_missing():
    r = ReceiverPages("r", 2)
    with pytest.raises(TransferError, match="expected page seq_no 0"):
        r.check(1, 0)
    r.check(0, 1)
    r.filled(1, 8)
    with pytest.raises(TransferError, match="outside"):
        r.check(1, 5)
    with pytest.raises(TransferError, match="twice"):
        r.check(1, 1)
    with pytest.raises(TransferError, match="incomplete"):
        r.complete(1)
    r.check(1, 0)
    r.filled(0, 8)
    r.complete(2)
    r.acked()
    assert r.states == [PageState.ACKED] * 2
