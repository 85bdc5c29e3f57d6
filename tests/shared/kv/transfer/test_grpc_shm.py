"""The grpc-shm transport between the connectors, with both ends' real shipper processes: pages arrive intact and
counted; auto takes it only when both ends run a shipper; a forced grpc-shm that cannot work fails at once on the
end that knows; a shipper that dies mid-transfer fails the request UNAVAILABLE on both ends (pages freed); bytes
changed on the way fail DATA_LOSS."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from connector_testutil import LAYOUT, N, Pair, Settings, counters, rows

from pdserve.errors import PeerUnavailable, TransferError, TransportUnusable
from pdserve.kv.shipper import link as link_module
from pdserve.kv.transfer import ExportedPages
from pdserve.kv.transfer.grpc_shm import start_shipper
from pdserve.server.status import engine_error_code
from pdserve.v1 import internal_pb2

ON = Settings(kv_shipper="on")


def imported(pair: Pair) -> torch.Tensor:
    return torch.cat([b for _, b in sorted(pair.imported, key=lambda x: x[0])])


@pytest.mark.parametrize("batch_mb", [1.0, 0.001], ids=["one batch", "a page a batch"])
def test_pages_move_through_the_shippers(batch_mb):
    pair = Pair(Settings(kv_shipper="on", kv_batch_mb=batch_mb), ON)
    try:
        tx = pair.open()
        assert tx.transport == pair.rx.transport == "grpc-shm"
        assert "bytes through the shippers" in tx.choice.transport.reason
        pages = rows()
        pair.ship(pages)
        pair.finish()
        assert torch.equal(imported(pair), pages)
        assert pair.released == ["r"] and pair.freed == [] and pair.rx.pages.completed
        assert counters(pair.pc.stats, "grpc-shm") == counters(pair.dc.stats, "grpc-shm") == (1, N, 0)
        assert pair.pc.stats.get("grpc-shm").batches == (1 if batch_mb == 1.0 else N)
        assert pair.dc.shipper is not None and pair.dc.shipper.events()["dropped"] == 0
    finally:
        pair.close()


@pytest.mark.parametrize("prefill_shippers, decode_shippers", [(2, 2), (3, 2), (1, 3)])
def test_decode_offers_every_shipper_and_batches_spread_over_them(prefill_shippers, decode_shippers):
    pair = Pair(
        Settings(kv_shipper="on", kv_batch_mb=0.001, kv_shippers=prefill_shippers),
        Settings(kv_shipper="on", kv_shippers=decode_shippers),
    )
    try:
        assert pair.dc.shipper is not None and pair.pc.shipper is not None
        offered = [pair.offer.shipper_address, *pair.offer.more_shipper_addresses]
        assert offered == pair.dc.shipper.addresses("127.0.0.1") and len(set(offered)) == decode_shippers
        pair.open()
        pages = rows()
        pair.ship(pages)
        pair.finish()
        assert torch.equal(imported(pair), pages)
        assert counters(pair.pc.stats, "grpc-shm") == counters(pair.dc.stats, "grpc-shm") == (1, N, 0)
    finally:
        pair.close()


def test_batches_that_land_out_of_order_reach_the_pool_in_order(monkeypatch):
    """Over several shippers batches land in any order: here in reverse, with one copy thread at decode (a batch
    scheduled before an earlier one would hold that thread waiting for it)."""
    pair = Pair(Settings(kv_shipper="on", kv_batch_mb=0.001), Settings(kv_shipper="on", kv_copy_threads=1))
    try:
        pair.open()
        assert pair.pc.shipper is not None
        push, held = pair.pc.shipper.push, []
        monkeypatch.setattr(pair.pc.shipper, "push", lambda *a: held.append(a))
        pages = rows()
        pair.ship(pages)
        for args in reversed(held):
            push(*args)
        pair.finish()
        assert [indexes for indexes, _ in pair.imported] == [[i] for i in range(N)]
        assert torch.equal(imported(pair), pages)
    finally:
        pair.close()


def test_a_prefill_that_knows_only_the_first_address_pushes_everything_there():
    pair = Pair(Settings(kv_shipper="on", kv_batch_mb=0.001), ON)
    try:
        del pair.offer.more_shipper_addresses[:]  # as a prefill that predates the field reads the offer
        pair.open()
        pages = rows()
        pair.ship(pages)
        pair.finish()
        assert torch.equal(imported(pair), pages)
    finally:
        pair.close()


def test_start_shipper_splits_the_arena():
    cfg = SimpleNamespace(kv_transport="grpc-shm", kv_shippers=3, kv_shipper_arena_mb=3.0)
    group = start_shipper(cfg, "decode", torch.device("cpu"))
    try:
        assert group is not None and len(group.links) == 3 and group.ready()
        assert group.arena_bytes == 1 << 20 and len(set(group.pids)) == 3
        assert len(set(group.addresses("h"))) == 3  # each picked a free port (consecutive ones: test_group)
    finally:
        if group is not None:
            group.close()
    bare = start_shipper(SimpleNamespace(kv_transport="grpc-shm"), "prefill", torch.device("cpu"))
    try:
        assert bare is not None and len(bare.links) == 1  # a bare namespace (benches): one shipper
    finally:
        if bare is not None:
            bare.close()


@pytest.mark.parametrize("prefill_on, decode_on", [(True, False), (False, True)])
def test_auto_uses_grpc_unless_both_ends_run_a_shipper(prefill_on, decode_on):
    pair = Pair(ON if prefill_on else Settings(), ON if decode_on else Settings())
    try:
        assert ("grpc-shm" in pair.offer.transports) == decode_on
        tx = pair.open()
        assert tx.transport == pair.rx.transport == "grpc"
        pair.ship(rows())
        pair.finish()
    finally:
        pair.close()


def test_a_forced_grpc_shm_that_cannot_work_fails_on_the_end_that_knows(monkeypatch):
    pair = Pair(Settings(kv_transport="grpc-shm"), Settings())  # decode offers no grpc-shm
    try:
        with pytest.raises(TransportUnusable, match="grpc-shm forced but unusable: decode offers only") as e:
            pair.pc.open("r", N, LAYOUT, pair.offer)
    finally:
        pair.close()
    assert engine_error_code(e.value).name == "FAILED_PRECONDITION"
    # decode forced, its shipper down (and not yet due to start again): the request is refused before it leaves
    monkeypatch.setattr(link_module, "RESTART_AFTER_S", 3600.0)
    pair = Pair(ON, Settings(kv_transport="grpc-shm"))
    try:
        assert pair.offer.forced and list(pair.offer.transports) == ["grpc-shm"]
        assert pair.dc.shipper is not None and len(pair.dc.shipper.links) == 2
        dead = pair.dc.shipper.links[1]  # one of decode's shippers down: no grpc-shm offer
        assert dead.pid is not None
        os.kill(dead.pid, signal.SIGKILL)
        dead._proc.wait()  # type: ignore[union-attr]
        rx = pair.dc.open("r2", N, lambda: None, pair.import_rows, peer="prefill-0")
        with pytest.raises(TransportUnusable, match="decode's KV shipper is not running"):
            next(rx.messages(internal_pb2.PrefillRequest(request_id="r2")))
    finally:
        pair.close()


def test_a_decode_shipper_that_dies_mid_transfer_fails_both_ends_unavailable(monkeypatch):
    """Pages 0-1 arrive; page 2's descriptor reaches decode while its bytes are still on their way (held back here);
    then decode's shipper dies: decode fails the transfer UNAVAILABLE (not DATA_LOSS: nothing was wrong with the
    bytes), prefill hears its push stream break and fails UNAVAILABLE too; pages go back on both ends."""
    monkeypatch.setattr(link_module, "RESTART_AFTER_S", 3600.0)
    pair = Pair(Settings(kv_shipper="on", kv_batch_mb=0.001), ON)
    try:
        pair.open()
        pages = rows()
        for m in pair.tx.send(ExportedPages([0, 1], [4, 4], pages[:2])):
            assert pair.rx.receive(m.SerializeToString()) is None
        assert pair.pc.shipper is not None and pair.dc.shipper is not None
        monkeypatch.setattr(pair.pc.shipper, "push", lambda *a: None)  # page 2's bytes never leave
        for m in pair.tx.send(ExportedPages([2], [4], pages[2:3])):
            assert pair.rx.receive(m.SerializeToString()) is None
        # page 2 took prefill's shipper 0 (batches rotate over the two), which pushes to decode's shipper 0
        dead = pair.dc.shipper.links[0].pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        done = internal_pb2.PrefillDone(num_pages=pair.tx.pages.num_shipped)
        with pytest.raises(PeerUnavailable, match="did not arrive: the decode side's KV shipper process exited") as de:
            pair.rx.finish(done)
        assert engine_error_code(de.value).name == "UNAVAILABLE"
        deadline = time.monotonic() + 20
        while not pair.tx.sender.failure() and time.monotonic() < deadline:  # the Push stream breaks
            time.sleep(0.05)
        with pytest.raises(PeerUnavailable, match="push to decode's shipper") as pe:
            pair.tx.poll()
        assert engine_error_code(pe.value).name == "UNAVAILABLE"
        pair.rx.close()
        assert pair.freed == [1]  # decode's reserved pages given back
        pair.tx.abort()
        assert pair.released == ["r"]
    finally:
        pair.close()


def test_bytes_changed_on_the_way_fail_data_loss(monkeypatch):
    pair = Pair(ON, ON)
    try:
        pair.open()
        link = pair.pc.shipper
        assert link is not None
        push = link.push

        def flip(addresses, key, seq_no, block, nbytes):
            block.tensor[7] ^= 0x40  # after the checksum, before the shipper reads it
            push(addresses, key, seq_no, block, nbytes)

        monkeypatch.setattr(link, "push", flip)
        pair.ship(rows())
        done = internal_pb2.PrefillDone(num_pages=pair.tx.pages.num_shipped)
        with pytest.raises(TransferError, match="checksum|CRC") as e:
            pair.rx.finish(done)
        assert engine_error_code(e.value).name == "DATA_LOSS"
        assert pair.imported == []
    finally:
        pair.close()
