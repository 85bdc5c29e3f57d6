"""The per-role connectors driven against each other in process, the Prefill stream's messages serialized and
parsed as on the wire: pages move over grpc and cuda-ipc (CPU shared-memory copier), a cuda-ipc buffer decode cannot
open falls back to grpc on both ends through the one fallback (counted on both), a forced cuda-ipc fails alike on
both ends, and each end's errors map to one status through the one table (a protocol break is DATA_LOSS on both)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from connector_testutil import CPU, LAYOUT, N, Pair, Settings, counters, rows, wire

from pdserve.errors import DeadlineExceeded, PeerUnavailable, TransferError, TransportUnusable
from pdserve.kv.transfer import ExportedPages
from pdserve.kv.transfer import prefill_side as prefill_side_module
from pdserve.kv.transfer.cuda_ipc import CudaIpcCopier, IpcBufferCache, ShmCopier
from pdserve.server.status import engine_error_code
from pdserve.v1 import internal_pb2


@pytest.mark.parametrize("forced", [False, True], ids=["grpc", "cuda-ipc"])
def test_pages_move_between_the_connectors(forced):
    """Decode forcing cuda-ipc on a CPU host: shared memory; else grpc. The pages arrive intact, prefill frees its
    copies once all are acked, both ends count one request."""
    decode = Settings(kv_transport="cuda-ipc" if forced else "auto")
    pair = Pair(Settings(), decode)
    try:
        tx = pair.open()
        transport = "cuda-ipc" if forced else "grpc"
        assert tx.transport == transport
        pages = rows()
        pair.ship(pages)
        pair.finish()
        assert torch.equal(torch.cat([b for _, b in sorted(pair.imported, key=lambda x: x[0])]), pages)
        assert pair.released == ["r"] and pair.freed == [] and pair.rx.pages.completed
        assert counters(pair.pc.stats, transport) == counters(pair.dc.stats, transport) == (1, N, 0)
        assert pair.dc.buffers.opens == int(forced)
    finally:
        pair.close()


def test_a_buffer_decode_cannot_open_falls_back_to_grpc_on_both_ends(monkeypatch):
    """Prefill picks cuda-ipc (same host, CUDA on both ends as far as it knows); decode cannot open the buffer
    (another kind), answers so, and both ends move this request over grpc, each counting one fallback."""
    monkeypatch.setattr(prefill_side_module, "copier_for", lambda device: ShmCopier())  # staging on "CUDA"
    pair = Pair(Settings(), Settings(), prefill_device=torch.device("cuda"))
    try:
        pair.offer.transports[:] = ["cuda-ipc", "grpc"]
        pair.offer.device_kind = "cuda"
        pair.dc.buffers = IpcBufferCache(CudaIpcCopier(CPU))  # moves "cuda" buffers: prefill's is "shm"
        tx = pair.open()
        assert pair.rx.transport == "grpc" and tx.choice.transport.transport == "cuda-ipc"
        pages = rows()
        pair.ship(pages)
        assert tx.transport == "grpc"  # prefill switched on decode's answer, before the first batch
        pair.finish()
        assert len(pair.imported) == 1 and torch.equal(pair.imported[0][1], pages)
        assert counters(pair.pc.stats, "cuda-ipc") == counters(pair.dc.stats, "cuda-ipc") == (0, 0, 1)
        assert counters(pair.pc.stats, "grpc") == counters(pair.dc.stats, "grpc") == (1, N, 0)
    finally:
        pair.close()


def test_a_forced_cuda_ipc_that_cannot_work_is_failed_precondition_on_both_ends(monkeypatch):
    monkeypatch.setattr(prefill_side_module, "copier_for", lambda device: ShmCopier())
    decode_forced = Pair(Settings(), Settings(kv_transport="cuda-ipc"))
    try:
        decode_forced.dc.buffers = IpcBufferCache(CudaIpcCopier(CPU))
        with pytest.raises(TransportUnusable, match="forced but unusable") as on_decode:
            decode_forced.open()
    finally:
        decode_forced.close()
    prefill_forced = Pair(Settings(kv_transport="cuda-ipc"), Settings(), prefill_device=torch.device("cuda"))
    try:
        prefill_forced.offer.transports[:] = ["cuda-ipc", "grpc"]
        prefill_forced.offer.device_kind = "cuda"
        prefill_forced.dc.buffers = IpcBufferCache(CudaIpcCopier(CPU))
        tx = prefill_forced.open()  # decode falls back and says why; prefill may not
        with pytest.raises(TransportUnusable, match="forced but unusable: decode: cannot open") as on_prefill:
            tx.send(ExportedPages([0], [4], rows(1)))
        tx.abort()
        assert prefill_forced.released == ["r"]
    finally:
        prefill_forced.close()
    assert engine_error_code(on_decode.value) == engine_error_code(on_prefill.value)
    assert engine_error_code(on_decode.value) == grpc.StatusCode.FAILED_PRECONDITION


def test_a_protocol_break_is_data_loss_on_both_ends():
    pair = Pair(Settings(), Settings())
    try:
        tx = pair.open()
        pages = rows()
        first = list(tx.send(ExportedPages([0, 1], [4, 4], pages[:2])))
        with pytest.raises(TransferError, match="shipped twice") as on_prefill:
            tx.send(ExportedPages([1], [4], pages[1:2]))  # a page shipped twice: prefill's own break
        assert pair.rx.receive(wire(first[0])) is None
        with pytest.raises(TransferError, match="bad KV batch from prefill") as on_decode:
            pair.rx.receive(wire(first[0]))  # the same batch again: a repeat
        done = internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(num_pages=N))
        with pytest.raises(TransferError, match="incomplete"):
            pair.rx.finish(pair.rx.receive(wire(done)).done)
        pair.rx.close()
        assert pair.freed == [1] and pair.cancelled == [1]  # decode's reserved pages freed, the stream ended
        tx.abort()
        assert pair.released == ["r"]
    finally:
        pair.close()
    assert engine_error_code(on_prefill.value) == engine_error_code(on_decode.value) == grpc.StatusCode.DATA_LOSS


def test_a_batch_before_the_choice_or_an_unasked_first_token_is_data_loss():
    pair = Pair(Settings(), Settings())
    try:
        tx = pair.pc.open("r", N, LAYOUT, pair.offer)
        batch = next(iter(tx.send(ExportedPages([0], [4], rows(1)))))
        with pytest.raises(TransferError, match="before the transport choice"):
            pair.rx.receive(wire(batch))
        early = internal_pb2.PrefillServerMessage(first_token=internal_pb2.PrefillFirstToken(token_id=3))
        with pytest.raises(TransferError, match="unasked"):
            pair.rx.receive(wire(early))
        pair.rx.close()
        tx.abort()
    finally:
        pair.close()


def test_the_ack_bound_and_the_page_bound_are_deadline_exceeded():
    pair = Pair(Settings(ack_timeout_s=0.05), Settings(page_timeout_s=0.05))
    try:
        tx = pair.open()
        list(tx.send(ExportedPages([0], [4], rows(1))))  # shipped, never handed to decode: never acked
        tx.poll()
        time.sleep(0.1)
        with pytest.raises(DeadlineExceeded, match="ack_timeout_s=0.05s") as acks:
            tx.poll()
        deadline = time.monotonic() + 5
        while not pair.cancelled:  # decode's watchdog: no message from prefill for page_timeout_s
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pages = pair.rx.failure()
        assert isinstance(pages, DeadlineExceeded) and "page_timeout_s=0.05s" in str(pages)
        pair.rx.close()
        tx.abort()
    finally:
        pair.close()
    assert engine_error_code(acks.value) == engine_error_code(pages) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_decode_that_never_answers_the_cuda_ipc_choice_is_unavailable():
    pair = Pair(Settings(ack_timeout_s=5), Settings(kv_transport="cuda-ipc"))
    try:
        tx = pair.pc.open("r", N, LAYOUT, pair.offer)
        assert tx.transport == "cuda-ipc"
        tx.listen(iter(()))  # decode's side ended before it answered
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match="did not confirm") as err:
            tx.send(ExportedPages([0], [4], rows(1)))
        assert time.monotonic() - t0 < 4  # the stream's end ended the wait
        tx.abort()
        pair.rx.close()
    finally:
        pair.close()
    assert engine_error_code(err.value) == grpc.StatusCode.UNAVAILABLE
