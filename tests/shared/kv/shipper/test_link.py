"""Real shipper processes on both ends (`pdserve.kv.shipper`): bytes written into prefill's arena land in decode's,
in order, and regions come back; a full arena holds the stream and then fails it; bytes for no open transfer are
given back; the push port wants the internal token; a dead shipper fails what depended on it, starts again, and a
shipper never outlives its engine process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.kv.shipper import link as link_module
from pdserve.kv.shipper.link import ShipperDown, ShipperLink

MB = 1 << 20


def links(decode_env=None, prefill_env=None, decode_mb=1, arena_wait_s=60.0):
    pre = ShipperLink("prefill", 4 * MB, pin=False, environ=prefill_env).start()
    dec = ShipperLink("decode", decode_mb * MB, pin=False, environ=decode_env, arena_wait_s=arena_wait_s).start()
    return pre, dec


def fill(pre: ShipperLink, n: int, value: int):
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


def test_batches_land_in_order_and_regions_come_back():
    pre, dec = links()
    try:
        key = os.urandom(16)
        inbox = dec.inbox(key)
        landed: list[tuple[int, bool]] = []
        blocks = {}
        done = threading.Event()
        for seq in range(10):  # 10 x 300 KB through a 1 MB arena: only with regions given back

            def take(seq=seq):
                got = inbox.take(seq)
                landed.append((seq, got.nbytes == 300_000 and bool((got.tensor == seq).all())))
                dec.release(got)
                pre.give(blocks.pop(seq))  # as decode's ack does
                if len(landed) == 10:
                    done.set()

            inbox.when(seq, take)
            blocks[seq] = fill(pre, 300_000, seq)
            pre.push(dec.address("127.0.0.1"), key, seq, blocks[seq], 300_000)
        assert done.wait(20) and landed == [(seq, True) for seq in range(10)]
        inbox.close()
    finally:
        pre.close()
        dec.close()


def test_a_full_arena_holds_the_stream_then_fails_it_resource_exhausted():
    pre, dec = links(arena_wait_s=1.0)
    try:
        key = os.urandom(16)
        inbox = dec.inbox(key)
        failed = Failures()
        pre.watch(key, failed)
        for seq in range(3):  # 2 x 400 KB fit the 1 MB arena; the third waits, never released
            block = fill(pre, 400_000, seq)
            pre.push(dec.address("127.0.0.1"), key, seq, block, 400_000)
        assert failed.event.wait(20)
        assert "RESOURCE_EXHAUSTED" in failed.reasons[0] and "arena" in failed.reasons[0]
        assert inbox.take(0).nbytes == inbox.take(1).nbytes == 400_000
        with pytest.raises(ShipperDown):
            inbox.take(2)
    finally:
        pre.close()
        dec.close()


def test_bytes_for_no_open_transfer_are_given_back():
    pre, dec = links()
    try:
        stranger = fill(pre, 600_000, 1)
        pre.push(dec.address("127.0.0.1"), os.urandom(16), 0, stranger, 600_000)
        deadline = time.monotonic() + 10
        while dec.dropped == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert dec.dropped == 1
        key = os.urandom(16)
        inbox = dec.inbox(key)
        arrived = threading.Event()
        inbox.when(0, arrived.set)
        pre.push(dec.address("127.0.0.1"), key, 0, fill(pre, 600_000, 2), 600_000)  # fits only if given back
        assert arrived.wait(10) and bool((inbox.take(0).tensor == 2).all())
    finally:
        pre.close()
        dec.close()


def test_the_push_port_wants_the_internal_token():
    bare = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_INTERNAL_TOKEN")}  # (conftests set one)
    secured = {**bare, "PDSERVE_INTERNAL_TOKEN": "t" * 32}
    wrong = {**bare, "PDSERVE_INTERNAL_TOKEN": "w" * 32}
    for prefill_env, want in ((bare, "UNAUTHENTICATED"), (wrong, "PERMISSION_DENIED"), (secured, "")):
        pre, dec = links(decode_env=secured, prefill_env=prefill_env)
        try:
            key = os.urandom(16)
            inbox = dec.inbox(key)
            failed, arrived = Failures(), threading.Event()
            pre.watch(key, failed)
            inbox.when(0, arrived.set)
            pre.push(dec.address("127.0.0.1"), key, 0, fill(pre, 1000, 3), 1000)
            if not want:
                assert arrived.wait(10) and inbox.take(0).nbytes == 1000
            else:
                assert failed.event.wait(10) and want in failed.reasons[0], failed.reasons
                assert not arrived.is_set()
        finally:
            pre.close()
            dec.close()


def test_a_push_to_no_shipper_fails_unavailable():
    pre = ShipperLink("prefill", MB, pin=False).start()
    try:
        key, failed = os.urandom(16), Failures()
        pre.watch(key, failed)
        pre.push("127.0.0.1:1", key, 0, fill(pre, 100, 0), 100)
        assert failed.event.wait(20), "the push did not fail"
        assert "UNAVAILABLE" in failed.reasons[0], failed.reasons
    finally:
        pre.close()


def test_a_dead_shipper_fails_its_transfers_and_starts_again(monkeypatch):
    dec = ShipperLink("decode", MB, pin=False).start()
    try:
        inbox = dec.inbox(os.urandom(16))
        woke = threading.Event()
        inbox.when(0, woke.set)
        old = dec.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        assert woke.wait(10)
        with pytest.raises(ShipperDown, match="exited"):
            inbox.take(0)
        monkeypatch.setattr(link_module, "RESTART_AFTER_S", 0.0)
        assert dec.ready() and dec.pid != old and dec.restarts == 1 and dec.port > 0
    finally:
        dec.close()


def test_a_shipper_never_outlives_its_engine_process():
    code = (
        "import sys, time\n"
        "from pdserve.kv.shipper.link import ShipperLink\n"
        "link = ShipperLink('decode', 1 << 20, pin=False).start()\n"
        "print(link.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        os.kill(pid, 0)  # alive
        owner.kill()  # SIGKILL: no cleanup runs in the owner
        owner.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            _reap(pid)
            time.sleep(0.05)
        pytest.fail(f"shipper {pid} still runs after its engine process died")
    finally:
        owner.kill()


def _reap(pid: int) -> None:
    """The shipper is the killed owner's child: once it exits it is reparented and reaped by init (or a
    subreaper); a zombie still answers kill(0), so read its state instead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                raise ProcessLookupError
    except (OSError, IndexError):
        pass


def test_decode_starts_again_only_once_every_landed_region_is_back(monkeypatch):
    pre, dec = links()
    try:
        key = os.urandom(16)
        inbox = dec.inbox(key)
        arrived = threading.Event()
        inbox.when(0, arrived.set)
        pre.push(dec.address("127.0.0.1"), key, 0, fill(pre, 1000, 5), 1000)
        assert arrived.wait(10)
        held = inbox.take(0)  # a receiver reading it
        assert dec.pid is not None
        os.kill(dec.pid, signal.SIGKILL)
        dec._proc.wait()  # type: ignore[union-attr]
        monkeypatch.setattr(link_module, "RESTART_AFTER_S", 0.0)
        assert not dec.ready()  # the region is still read: no shipper may land bytes there yet
        dec.release(held)
        assert dec.ready() and dec.restarts == 1
    finally:
        pre.close()
        dec.close()


def test_an_idle_push_stream_ends_and_the_next_shipment_opens_another(capfd):
    pre = ShipperLink("prefill", 4 * MB, pin=False, idle_close_s=0.3, log_level="INFO").start()
    dec = ShipperLink("decode", MB, pin=False).start()
    try:
        key = os.urandom(16)
        inbox = dec.inbox(key)
        for seq in range(2):
            arrived = threading.Event()
            inbox.when(seq, arrived.set)
            pre.push(dec.address("127.0.0.1"), key, seq, fill(pre, 1000, seq), 1000)
            assert arrived.wait(10) and bool((inbox.take(seq).tensor == seq).all())
            time.sleep(1.0)  # past the idle bound: the stream ends
    finally:
        pre.close()
        dec.close()
    err = capfd.readouterr().err
    assert "push stream 1 to" in err and "push stream 2 to" in err, err
