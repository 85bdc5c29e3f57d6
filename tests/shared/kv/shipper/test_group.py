"""Groups of real shipper processes (`pdserve.kv.shipper.group`): consecutive batches take different shippers;
batches pushed through several prefill shippers land in one decode inbox intact, whichever shipper they came
through, and their regions go back to the arena that holds them; prefill's shipper k pushes to decode's address
k % len; one dead shipper fails the transfers that use the group (both ends) and `ready()` starts it again."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest

from pdserve.kv.shipper import link as link_module
from pdserve.kv.shipper.group import ShipperGroup, StagingBlock
from pdserve.kv.shipper.link import Inbox, Landed, ShipperDown

MB = 1 << 20
HOST = "127.0.0.1"


def groups(prefill: int, decode: int, decode_mb: int = 2, arena_wait_s: float = 60.0):
    pre = ShipperGroup.of("prefill", prefill, prefill * 4 * MB, pin=False).start()
    dec = ShipperGroup.of("decode", decode, decode_mb * MB, pin=False, arena_wait_s=arena_wait_s).start()
    return pre, dec


def fill(pre: ShipperGroup, n: int, value: int) -> StagingBlock:
    block = pre.reserve(n, 5)
    block.tensor[:n].fill_(value)
    return block


class Failures:
    def __init__(self):
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()


def ship(pre: ShipperGroup, dec: ShipperGroup, inbox: Inbox, seqs: range, n: int) -> dict[int, tuple[int, Landed]]:
    """Batches `seqs` of `n` bytes (each filled with its seq_no) through `pre` to `dec`; taken as they land:
    {seq: (the prefill shipper that pushed it, what landed)}, each block given back once its batch landed."""
    got: dict[int, tuple[int, Landed]] = {}
    all_in = threading.Event()
    lock = threading.Lock()
    for seq in seqs:
        block = fill(pre, n, seq % 256)

        def take(seq=seq, block=block):
            landed = inbox.take(seq)
            pre.give(block)  # as decode's ack does
            with lock:
                got[seq] = (block.index, landed)
                if len(got) == len(seqs):
                    all_in.set()

        inbox.when(seq, take)
        pre.push(dec.addresses(HOST), inbox.key, seq, block, n)
    assert all_in.wait(30), f"{len(got)} of {len(seqs)} batches landed"
    return got


def test_consecutive_reserves_take_different_shippers_and_skip_a_full_one():
    pre = ShipperGroup.of("prefill", 3, 3 * MB, pin=False)  # never started: reserving needs only the arenas
    try:
        assert pre.arena_bytes == MB and [link.arena.nbytes for link in pre.links] == [MB] * 3
        blocks = [pre.reserve(1000, 1) for _ in range(6)]
        assert [b.index for b in blocks] == [0, 1, 2, 0, 1, 2]
        for b in blocks:
            pre.give(b)
        hog = pre.links[1].reserve(MB // 2, 1), pre.links[1].reserve(MB // 2, 1)  # shipper 1 full
        assert [pre.reserve(MB // 4, 1).index for _ in range(3)] == [0, 2, 2]  # 1's turn goes to the next with room
        for b in hog:
            pre.links[1].give(b)
        assert [pre.reserve(MB // 4, 1).index for _ in range(2)] == [0, 1]  # given back: it takes its turn again
        with pytest.raises(ValueError, match="exceeds half"):
            pre.reserve(MB // 2 + 1, 1)
    finally:
        pre.close()


def test_none_free_waits_on_the_rotating_shipper_then_times_out():
    pre = ShipperGroup.of("prefill", 2, 2 * MB, pin=False)
    try:
        held = [pre.reserve(MB // 2, 1) for _ in range(4)]  # both arenas full
        with pytest.raises(TimeoutError):
            pre.reserve(MB // 2, 0.2)
        threading.Timer(0.3, pre.give, args=(held[1],)).start()  # shipper 1's block comes back
        assert pre.reserve(MB // 2, 5).index == 1  # the rotating turn is shipper 1's (the failed try took 0's)
    finally:
        pre.close()


def test_batches_through_two_prefill_shippers_land_in_one_inbox_and_go_back_to_their_arena():
    pre, dec = groups(prefill=2, decode=2, decode_mb=2, arena_wait_s=3.0)
    try:
        assert len(set(dec.addresses(HOST))) == 2 and all(a.startswith(f"{HOST}:") for a in dec.addresses(HOST))
        inbox = dec.inbox(os.urandom(16))
        # 12 x 300 KB into two 1 MB arenas: only with every region given back to the shipper that holds it
        got = {}
        for first in range(0, 12, 3):
            part = ship(pre, dec, inbox, range(first, first + 3), 300_000)
            for seq, (_, landed) in part.items():
                assert landed.nbytes == 300_000 and bool((landed.tensor == seq).all()), seq
                inbox.release(landed)
            got.update(part)
        assert {landed.link for _, landed in got.values()} == set(dec.links)  # both decode shippers carried some
        assert {index for index, _ in got.values()} == {0, 1}
        for seq, (index, landed) in got.items():
            assert landed.link is dec.links[index % 2], seq  # prefill's shipper k pushes to decode's k % 2
        assert dec.events() == {"restarts": 0, "dropped": 0}
        inbox.close()
        assert all(inbox.key not in link._inboxes for link in dec.links)
    finally:
        pre.close()
        dec.close()


def test_three_prefill_shippers_push_to_two_decode_shippers_in_turn():
    pre, dec = groups(prefill=3, decode=2, decode_mb=4)
    try:
        inbox = dec.inbox(os.urandom(16))
        got = ship(pre, dec, inbox, range(9), 100_000)
        assert sorted(index for index, _ in got.values()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        for seq, (index, landed) in got.items():
            assert landed.link is dec.links[index % 2], (seq, index)  # prefill 2 -> decode 0
            assert bool((landed.tensor == seq).all())
            inbox.release(landed)
        inbox.close()
    finally:
        pre.close()
        dec.close()


def test_a_transfer_key_in_use_is_refused_on_every_shipper():
    dec = ShipperGroup.of("decode", 2, 2 * MB, pin=False)
    try:
        key = os.urandom(16)
        dec.links[1].inbox(key)  # held by one shipper alone
        with pytest.raises(ValueError, match="in use"):
            dec.inbox(key)
        assert key not in dec.links[0]._inboxes  # the half-made registration was undone
    finally:
        dec.close()


def test_one_dead_decode_shipper_fails_the_inbox_and_the_prefill_transfer(monkeypatch):
    monkeypatch.setattr(link_module, "RESTART_AFTER_S", 3600.0)
    pre, dec = groups(prefill=2, decode=2)
    try:
        key = os.urandom(16)
        inbox = dec.inbox(key)
        failed = Failures()
        pre.watch(key, failed)
        for _, landed in ship(pre, dec, inbox, range(2), 1000).values():  # a Push stream to each
            inbox.release(landed)
        woke = threading.Event()
        inbox.when(5, woke.set)  # a batch still on its way
        dead = dec.links[1].pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        assert woke.wait(10)
        with pytest.raises(ShipperDown, match="exited"):
            inbox.take(5)
        assert failed.event.wait(20), "prefill did not hear the broken push stream"
        assert "UNAVAILABLE" in failed.reasons[0] or "push to decode's shipper" in failed.reasons[0], failed.reasons
        assert not dec.alive and not dec.ready()  # not before RESTART_AFTER_S
        assert pre.alive
    finally:
        pre.close()
        dec.close()


def test_one_dead_prefill_shipper_fails_the_watched_transfer():
    pre, dec = groups(prefill=2, decode=1)
    try:
        key, failed = os.urandom(16), Failures()
        pre.watch(key, failed)
        other, unwatched = os.urandom(16), Failures()
        pre.watch(other, unwatched)
        pre.unwatch(other)
        dead = pre.links[0].pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        assert failed.event.wait(10) and "exited" in failed.reasons[0], failed.reasons
        assert not pre.alive and not unwatched.event.is_set()
    finally:
        pre.close()
        dec.close()


def test_ready_starts_a_dead_shipper_again_and_leaves_the_others(monkeypatch):
    dec = ShipperGroup.of("decode", 3, 3 * MB, pin=False).start()
    try:
        before = dec.pids
        assert all(before) and dec.ready() and dec.alive
        dead = dec.links[1]
        ports = [link.port for link in dec.links]
        os.kill(before[1], signal.SIGKILL)  # type: ignore[arg-type]
        dead._proc.wait()  # type: ignore[union-attr]
        assert not dec.alive
        monkeypatch.setattr(link_module, "RESTART_AFTER_S", 0.0)
        assert dec.ready() and dec.alive
        after = dec.pids
        assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
        assert dec.events()["restarts"] == 1
        assert [link.port for link in dec.links] == ports  # the same Push port: offers already made stay good
    finally:
        dec.close()
    assert not dec.ready()


def test_decode_shippers_take_consecutive_ports_from_a_given_one():
    port = _free_ports(3)
    dec = ShipperGroup.of("decode", 3, 3 * MB, pin=False, port=port).start()
    try:
        assert dec.ready()
        assert dec.addresses("h") == [f"h:{port}", f"h:{port + 1}", f"h:{port + 2}"]
    finally:
        dec.close()


def _free_ports(n: int) -> int:
    """A port P with P..P+n-1 free now (a race with other processes is unlikely on a test host)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((HOST, 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind((HOST, p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")
