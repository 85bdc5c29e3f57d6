"""GPU-only paths of the KV transports (skipped without CUDA): the side-stream device -> pinned host copy and the
host -> device import of the grpc transport, grpc-shm through real shippers and pinned arenas, and cuda-ipc between
two processes (one GPU, or GPU0 -> GPU1 when two are visible) through the real CUDA IPC handle, with its copy rate
printed.

    .venv/bin/python -m pytest -q -s tests/shared/kv/transfer/test_transfer_gpu.py
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from pdserve.kv.transfer import ExportedPages, ReceiverPages, SenderPages
from pdserve.kv.transfer.cuda_ipc import CudaIpcCopier, IpcBufferCache, IpcStaging
from pdserve.kv.transfer.grpc_transport import GrpcReceiver, GrpcSender
from pdserve.kv.transfer.stats import TransferStats
from pdserve.kv.transfer.wire import BatchExpectation, parse_server_message
from pdserve.v1 import kv_pb2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB = 1 << 20


def finite_rows(n: int, page_bytes: int, dev: torch.device) -> torch.Tensor:
    """n random page rows on `dev` whose every fp16 pair is finite (receivers reject NaN/inf scales: DATA_LOSS)."""
    return torch.randn(n, page_bytes // 2, dtype=torch.float16, device=dev).view(torch.uint8)


def collecting(into: list):
    """An `ImportRows` that keeps each batch (on the device) in `into`, done at once."""
    from concurrent.futures import Future

    def import_rows(idx, tok, r, layers=None):
        assert r.device.type == "cuda"
        into.append(r)
        f: Future = Future()
        f.set_result(None)
        return f

    return import_rows


@pytest.mark.parametrize("threads", [0, 3], ids=["inline", "pool"])
def test_grpc_transport_device_to_pinned_to_device(threads):
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.errors import CorruptPage
    from pdserve.kv.codec import KVLayoutSpec
    from pdserve.kv.transfer.page_format import PageFormat

    layout = KVLayoutSpec("int8", page_size=16, num_layers=4, num_kv_heads=8, head_dim=128, group_size=64)
    fmt = PageFormat(layout)
    dev = torch.device("cuda:0")
    rows = finite_rows(64, fmt.page_bytes, dev)
    ready = torch.cuda.Event()
    ready.record()
    imported: list = []
    import_rows = collecting(imported)

    pool = ThreadPoolExecutor(threads) if threads else None
    sender = GrpcSender(
        SenderPages("r", 64), layout, "fp", TransferStats(), max_batch_bytes=8 * MiB, pool=pool, lookahead=threads
    )
    expect = BatchExpectation(layout, "fp", "r")
    recv = GrpcReceiver(ReceiverPages("r", 64), expect, TransferStats(), dev, import_rows)
    recv.pool = pool  # batches checked and copied on the pool, in order
    ex = ExportedPages(list(range(64)), [16] * 64, rows, ready)
    raws = list(sender.send(ex))
    assert len(raws) > 1  # several batches: the pool builds them ahead
    done = [recv.receive_async(*parse_server_message(raw)[1:]) for raw in raws]
    assert [f.result(30) for f in done] == sorted(f.result() for f in done)  # acks in stream order
    assert ex.host is not None and ex.host.is_pinned()
    assert torch.equal(torch.cat(imported), rows)
    # a flipped payload byte: refused (the device copy beside the check never reaches the pool)
    bad = bytearray(raws[0])
    bad[-1] ^= 0x01
    _, header, payload = parse_server_message(bytes(bad))
    other = GrpcReceiver(ReceiverPages("r", 64), expect, TransferStats(), dev, import_rows)
    other.pool = pool
    n = len(imported)
    with pytest.raises(CorruptPage, match="checksum"):
        other.receive_async(header, payload).result(30)
    assert len(imported) == n


@pytest.mark.parametrize("shippers", [1, 2])
def test_grpc_shm_device_to_pinned_arenas_to_device(shippers):
    """grpc-shm on CUDA with real shippers (`shippers` on each end): rows DMA'd into prefill's pinned arenas,
    pushed, landed in decode's pinned arenas, checked and DMA'd onto the device; equal, in order, blocks back on the
    acks."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.kv.codec import KVLayoutSpec
    from pdserve.kv.shipper.group import ShipperGroup
    from pdserve.kv.transfer.grpc_shm import ShmReceiver, ShmSender
    from pdserve.kv.transfer.page_format import PageFormat

    layout = KVLayoutSpec("int8", page_size=16, num_layers=4, num_kv_heads=8, head_dim=128, group_size=64)
    fmt = PageFormat(layout)
    dev = torch.device("cuda:0")
    rows = finite_rows(256, fmt.page_bytes, dev)
    ready = torch.cuda.Event()
    ready.record()
    imported: list = []
    import_rows = collecting(imported)

    pre = ShipperGroup.of("prefill", shippers, shippers * 64 * MiB, pin=True).start()
    dec = ShipperGroup.of("decode", shippers, shippers * 64 * MiB, pin=True).start()
    pool = ThreadPoolExecutor(3)
    try:
        assert all(link.arena.pinned for link in pre.links + dec.links)
        key = os.urandom(16)
        sender = ShmSender(
            SenderPages("r", 256), layout, "fp", TransferStats(), max_batch_bytes=8 * MiB,
            link=pre, addresses=dec.addresses("127.0.0.1"), key=key, reserve_timeout=10,
        )  # fmt: skip
        recv = ShmReceiver(
            ReceiverPages("r", 256), BatchExpectation(layout, "fp", "r"), TransferStats(), dev, import_rows,
            inbox=dec.inbox(key),
        )  # fmt: skip
        recv.pool = pool
        t0 = time.perf_counter()
        msgs = sender.send(ExportedPages(list(range(256)), [16] * 256, rows, ready))
        done = [recv.receive_async(m.shipped_batch.header, m.shipped_batch) for m in msgs]
        seqs = [f.result(30) for f in done]
        dt = time.perf_counter() - t0
        assert len(msgs) > 1 and seqs == sorted(seqs)
        assert torch.equal(torch.cat(imported), rows)
        free = sum(link.arena.free_bytes for link in pre.links)
        sender.ack(seqs[-1])
        assert sum(link.arena.free_bytes for link in pre.links) > free  # the staging blocks came back with the ack
        rate = rows.numel() / dt / 1e9
        print(f"\ngrpc-shm device -> device through {shippers} shipper pair(s): {rate:.2f} GB/s (one request)")
    finally:
        pool.shutdown()
        pre.close()
        dec.close()


def _consumer(desc_bytes: bytes, device: int, offset: int, nbytes: int, out: mp.Queue) -> None:
    try:
        dev = torch.device("cuda", device)
        torch.cuda.set_device(dev)
        cache = IpcBufferCache(CudaIpcCopier(dev))
        desc = kv_pb2.KVIpcBuffer.FromString(desc_bytes)
        buf = cache.get(desc)
        cache.get(desc)
        region = buf[offset : offset + nbytes]
        rows = cache.copier.fetch(region)  # warm-up
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        reps = 10
        for _ in range(reps):
            rows = cache.copier.fetch(region)
        dt = (time.perf_counter() - t0) / reps
        # plain Python values only: a tensor in the queue would be shared by fd and die with this process
        out.put(("ok", rows.sum(dtype=torch.int64).item(), rows[:4096].cpu().tolist(), cache.opens, nbytes / dt / 1e9))
    except Exception as e:  # report, do not hang the parent
        out.put(("error", repr(e), None, 0, 0.0))


@pytest.mark.parametrize("peer", [0, 1], ids=["same-gpu", "gpu0-to-gpu1"])
def test_cuda_ipc_between_two_processes(peer):
    if peer >= torch.cuda.device_count():
        pytest.skip("needs a second visible GPU")
    dev = torch.device("cuda:0")
    staging = IpcStaging(CudaIpcCopier(dev), 512 * MiB)
    nbytes = 256 * MiB
    rows = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    ready = torch.cuda.Event()
    ready.record()
    offset = staging.reserve(nbytes, timeout=1)
    staging.copier.stage(staging.region(offset, nbytes), ExportedPages([0], [1], rows, ready), rows)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_consumer, args=(staging.desc.SerializeToString(), peer, offset, nbytes, out))
    p.start()
    status, total, head, opens, gbps = out.get(timeout=120)
    p.join(30)
    assert status == "ok", total
    assert total == rows.sum(dtype=torch.int64).item() and head == rows[:4096].cpu().tolist()
    assert opens == 1  # the handle is opened once, then cached
    print(f"\ncuda-ipc fetch GPU0 -> GPU{peer}: {gbps:.0f} GB/s")
