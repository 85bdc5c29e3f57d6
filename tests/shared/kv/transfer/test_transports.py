"""Both transports driven in process, end to end from pool to pool: the batch gather/scatter equals the prompt
cache's per-page import of the same pages, grpc ships verified batches and frees on ack, cuda-ipc (CPU shared-memory
copier) reuses its staging regions only after acks, opens a peer buffer once, and the handshake picks (or refuses)
right."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from pdserve.engine.kv_cache import KVCache, QuantizedKVCache
from pdserve.errors import CorruptPage
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload, quantize_payload
from pdserve.kv.transfer import ExportedPages, ReceiverPages, SenderPages, TransferError
from pdserve.kv.transfer.cuda_ipc import IpcBufferCache, IpcReceiver, IpcSender, IpcStaging, ShmCopier
from pdserve.kv.transfer.grpc_transport import GrpcReceiver, GrpcSender
from pdserve.kv.transfer.handshake import choose, make_offer
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.stats import TransferStats
from pdserve.kv.transfer.wire import BatchExpectation, parse_server_message

L, P, PS, H, D, G = 2, 8, 4, 2, 16, 8
INT8 = KVLayoutSpec("int8", page_size=PS, num_layers=L, num_kv_heads=H, head_dim=D, group_size=G)
FP8 = KVLayoutSpec("fp8", page_size=PS, num_layers=L, num_kv_heads=H, head_dim=D, group_size=D)
F32 = KVLayoutSpec("float32", page_size=PS, num_layers=L, num_kv_heads=H, head_dim=D)
CPU = torch.device("cpu")


def dense_pool(seed: int = 0) -> KVCache:
    pool = KVCache(L, P, PS, H, D, torch.float32, CPU)
    pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


@pytest.mark.parametrize("layout", [INT8, FP8, F32], ids=["int8", "fp8", "float32"])
def test_batch_gather_scatter_equals_per_page_path(layout):
    src = dense_pool()
    pages, tokens = [5, 2, 7], [4, 4, 3]
    quantized, g, dt = layout.quantized, layout.group_size, layout.torch_dtype
    rows = PageFormat(layout).pack(*src.gather_pages(pages, tokens, quantized, g, False, dt))

    def new_pool():
        return (
            QuantizedKVCache(L, P, PS, H, D, torch.float32, CPU, g, False, storage=dt)
            if quantized
            else KVCache(L, P, PS, H, D, torch.float32, CPU)
        )

    batch, per_page = new_pool(), new_pool()
    batch.scatter_pages([0, 1, 2], *PageFormat(layout).unpack(rows), layout.group_size)
    for dst, (p, n) in enumerate(zip(pages, tokens)):
        dense = PagePayload(dst, n, 0, src.data[:, :, p, :n].clone(), None, None)  # the page, exported by hand
        per_page.import_page(dst, quantize_payload(dense, g, False, dt) if quantized else dense)
    for a, b, n in zip(batch.data.unbind(2), per_page.data.unbind(2), [4, 4, 3, 0, 0, 0, 0, 0]):
        assert torch.equal(a[:, :, :n].view(torch.uint8), b[:, :, :n].view(torch.uint8))
    if quantized:
        assert batch.data.dtype == dt
        assert torch.equal(batch.scales[:, :, :2], per_page.scales[:, :, :2])


def run_pair(sender, receiver, exported: ExportedPages, imported: list) -> list[int]:
    """Ship through the messages the sender yields (serialized and parsed as on the stream); returns acks."""
    acks = []
    for m in sender.send(exported):
        raw = m if isinstance(m, bytes) else m.SerializeToString()
        msg, header, payload = parse_server_message(raw)
        seq = (
            receiver.receive(header, payload)
            if header is not None
            else receiver.receive(msg.ipc_batch.header, msg.ipc_batch)
        )
        acks.append(seq)
    return acks


def importer(imported: list):
    def import_rows(idx, tok, rows, layers=None) -> Future:
        f: Future = Future()
        imported.append((idx, tok, rows.clone()))
        f.set_result(None)
        return f

    return import_rows


@pytest.mark.parametrize("threads", [0, 2], ids=["inline", "pool"])
@pytest.mark.parametrize("layout", [INT8, FP8], ids=["int8", "fp8"])
def test_grpc_pair_batches_verifies_and_frees_on_ack(layout, threads):
    fmt = PageFormat(layout)
    g, dt = layout.group_size, layout.torch_dtype
    rows = fmt.pack(*dense_pool().gather_pages([0, 1, 2, 3, 4], [4] * 4 + [1], True, g, False, dt))
    freed, stats_s, stats_r, imported = [], TransferStats(), TransferStats(), []
    pages = SenderPages("r", 5, free=lambda: freed.append(1))
    pool = ThreadPoolExecutor(threads) if threads else None
    sender = GrpcSender(pages, layout, "fp", stats_s, max_batch_bytes=2 * fmt.page_bytes, pool=pool, lookahead=threads)
    recv = GrpcReceiver(ReceiverPages("r", 5), BatchExpectation(layout, "fp", "r"), stats_r, CPU, importer(imported))
    ex = ExportedPages([0, 1, 2, 3, 4], [4, 4, 4, 4, 1], rows)
    acks = run_pair(sender, recv, ex, imported)
    assert acks == [1, 3, 4]  # 2 pages a message
    assert torch.equal(torch.cat([r for _, _, r in imported]), rows) and ex.host is not None
    for a in acks[:-1]:
        assert sender.ack(a) is False and not freed
    assert sender.ack(acks[-1]) is True and freed == [1]
    recv.finish(5, timeout=1)
    sender.close()
    s, r = stats_s.get("grpc"), stats_r.get("grpc")
    assert (
        (s.requests, s.pages, s.batches, s.bytes)
        == (1, 5, 3, rows.numel())
        == (r.requests, r.pages, r.batches, r.bytes)
    )
    assert s.transfer_seconds > 0 and r.transfer_seconds > 0


def test_grpc_sender_books_every_batch_at_once_and_builds_a_bounded_few_ahead():
    """The writer builds a chunk's first message when it asks; the next `lookahead` are built on the pool meanwhile."""
    fmt = PageFormat(INT8)
    n = 12
    rows = torch.randint(0, 255, (n, fmt.page_bytes), dtype=torch.uint8)
    built: list[int] = []
    gate = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        pages = SenderPages("r", n)
        sender = GrpcSender(pages, INT8, "fp", TransferStats(), max_batch_bytes=fmt.page_bytes, pool=pool, lookahead=3)
        build = sender._message

        def slow_build(job):
            built.append(job[0])
            gate.wait(5)
            return build(job)

        sender._message = slow_build  # type: ignore[method-assign]
        msgs = iter(sender.send(ExportedPages(list(range(n)), [PS] * n, rows)))
        assert pages.num_shipped == n  # booked before any message is built
        time.sleep(0.2)
        assert sorted(built) == [1, 2, 3]  # the lookahead, started before the writer asked; the first is its own
        gate.set()
        got = [parse_server_message(m)[1].first_seq_no for m in msgs]
    assert got == list(range(n)) and sorted(built) == list(range(n))  # in order, each built once


def test_grpc_receiver_pool_fills_and_acks_in_order_and_a_bad_batch_fails_the_rest():
    fmt = PageFormat(INT8)
    rows = fmt.pack(*dense_pool().gather_pages(list(range(6)), [PS] * 6, True, G, False, torch.int8))
    sender = GrpcSender(SenderPages("r", 6), INT8, "fp", TransferStats(), max_batch_bytes=fmt.page_bytes)
    msgs = [parse_server_message(m)[1:] for m in sender.send(ExportedPages(list(range(6)), [PS] * 6, rows))]
    imported: list = []
    pages = ReceiverPages("r", 6, free=lambda: None)
    recv = GrpcReceiver(pages, BatchExpectation(INT8, "fp", "r"), TransferStats(), CPU, importer(imported))
    with ThreadPoolExecutor(3) as pool:
        recv.pool = pool
        good = [recv.receive_async(h, p) for h, p in msgs[:3]]
        assert [f.result(5) for f in good] == [0, 1, 2]
        assert [idx for idx, _, _ in imported] == [[0], [1], [2]]  # into the pool in stream order
        header, payload = msgs[3]
        bad = bytearray(payload)
        bad[0] ^= 1
        failed = recv.receive_async(header, memoryview(bytes(bad)))
        later = recv.receive_async(*msgs[4])  # claimed in order, but an earlier batch failed: so does this one
        with pytest.raises(CorruptPage, match="checksum"):
            failed.result(5)
        with pytest.raises(CorruptPage, match="checksum"):
            later.result(5)
    assert len(imported) == 3 and pages.next_seq_no == 3
    with pytest.raises(TransferError):
        recv.receive_async(*msgs[2])  # a repeat: refused before any fetch


def test_sender_clock_spans_a_whole_send_and_drain_waits_for_the_last_ack():
    fmt = PageFormat(INT8)
    rows = torch.randint(0, 255, (3, fmt.page_bytes), dtype=torch.uint8)
    sender = GrpcSender(SenderPages("r", 3), INT8, "fp", TransferStats(), max_batch_bytes=fmt.page_bytes)
    assert len(list(sender.send(ExportedPages([0, 1, 2], [PS] * 3, rows)))) == 3
    with pytest.raises(TimeoutError):
        sender.drain(0.05)
    sender.ack(0)
    assert sender.clock.seconds() == 0  # one send, one span: open until its last batch is acked
    waiter = threading.Thread(target=sender.drain, args=(5,))
    waiter.start()
    time.sleep(0.05)
    sender.ack(2)
    waiter.join(5)
    assert not waiter.is_alive() and sender.clock.seconds() > 0.05
    other = GrpcSender(SenderPages("s", 1), INT8, "fp", TransferStats(), max_batch_bytes=fmt.page_bytes)
    list(other.send(ExportedPages([0], [PS], rows[:1])))
    other.acks_ended()  # decode closed its side: nothing left to wait for
    other.drain(0.05)


class SlowGather:
    """A `ready` event whose gather completes `seconds` after the sender asks (the device still computing)."""

    def __init__(self, seconds: float):
        self.seconds, self.waited = seconds, 0

    def synchronize(self) -> None:
        time.sleep(self.seconds)
        self.waited += 1


@pytest.mark.parametrize("transport", ["grpc", "cuda-ipc"])
def test_sender_clock_starts_when_the_rows_exist(transport, tmp_path):
    """A layer group reaches the sender when the engine thread queued its gather; the device may still compute the
    layers before it. The transfer clock starts after the `ready` event, so kv_gbps counts the bytes' trip only."""
    fmt = PageFormat(F32)
    rows = torch.randn(2, fmt.page_bytes // 4).view(torch.uint8)
    if transport == "grpc":
        sender = GrpcSender(SenderPages("r", 2), F32, "fp", TransferStats(), max_batch_bytes=2 * fmt.page_bytes)
    else:
        staging = IpcStaging(ShmCopier(str(tmp_path)), 4 * fmt.page_bytes)
        sender = IpcSender(
            SenderPages("r", 2), F32, "fp", TransferStats(), 2 * fmt.page_bytes, staging=staging, reserve_timeout=5
        )
    gather = SlowGather(0.3)
    t0 = time.perf_counter()
    assert len(list(sender.send(ExportedPages([0, 1], [PS, PS], rows, ready=gather)))) == 1
    sender.ack(1)
    assert gather.waited == 1 and time.perf_counter() - t0 >= 0.3
    assert 0 < sender.clock.seconds() < 0.3
    sender.close()
    if transport == "cuda-ipc":
        staging.close()


def test_ipc_pair_reuses_staging_only_after_acks(tmp_path):
    fmt = PageFormat(F32)
    staging = IpcStaging(ShmCopier(str(tmp_path)), 2 * fmt.page_bytes)  # room for one 2-page batch at a time
    cache = IpcBufferCache(ShmCopier(str(tmp_path)))
    cache.get(staging.desc)
    freed, stats, imported = [], TransferStats(), []
    pages = SenderPages("r", 4, free=lambda: freed.append(1))
    sender = IpcSender(pages, F32, "fp", stats, max_batch_bytes=1 << 30, staging=staging, reserve_timeout=5)
    assert sender.rows_per_batch == 1  # half the staging buffer: two regions can be in flight
    recv = IpcReceiver(
        ReceiverPages("r", 4),
        BatchExpectation(F32, "fp", "r"),
        stats,
        CPU,
        importer(imported),
        buffers=cache,
        buffer_id=staging.desc.buffer_id,
    )
    src = dense_pool(1)
    rows = fmt.pack(*src.gather_pages([0, 1, 2, 3], [4] * 4, False))
    first = run_pair(sender, recv, ExportedPages([0, 1], [4, 4], rows[:2]), imported)
    assert first == [0, 1] and staging.in_use == 2 * fmt.page_bytes  # both regions held until acked
    blocked = threading.Thread(target=lambda: run_pair(sender, recv, ExportedPages([2, 3], [4, 4], rows[2:]), imported))
    blocked.start()
    time.sleep(0.2)
    assert blocked.is_alive() and len(imported) == 2  # no region free: the writer waits for an ack
    sender.ack(1)
    blocked.join(5)
    assert not blocked.is_alive() and len(imported) == 4
    assert torch.equal(torch.cat([r for _, _, r in imported]), rows)  # bytes intact through reused regions
    with pytest.raises(TimeoutError):
        sender.drain(0.05)  # PrefillDone waits until decode no longer reads the staging buffer
    assert sender.ack(3) is True and freed == [1]
    sender.drain(0.05)
    recv.finish(4, timeout=1)
    sender.close()
    assert staging.in_use == 0 and cache.opens == 1
    c = stats.get("cuda-ipc")
    assert c.pages == 8 and c.batches == 8 and c.requests == 2  # sender and receiver booked into one object here
    staging.close()


def test_ipc_abandon_releases_regions(tmp_path):
    fmt = PageFormat(F32)
    staging = IpcStaging(ShmCopier(str(tmp_path)), 4 * fmt.page_bytes)
    freed = []
    sender = IpcSender(
        SenderPages("r", 2, free=lambda: freed.append(1)),
        F32,
        "fp",
        TransferStats(),
        max_batch_bytes=1 << 30,
        staging=staging,
        reserve_timeout=1,
    )
    sender.send(ExportedPages([0, 1], [4, 4], torch.zeros(2, fmt.page_bytes, dtype=torch.uint8)))
    assert staging.in_use > 0
    sender.close()
    assert staging.in_use == 0 and freed == [1]
    staging.close()


def test_ipc_buffer_cache_refuses_foreign_buffers(tmp_path):
    cache = IpcBufferCache(ShmCopier(str(tmp_path)))
    staging = IpcStaging(ShmCopier(str(tmp_path)), 1024)
    bad = type(staging.desc)()
    bad.CopyFrom(staging.desc)
    bad.path = "/etc/passwd"
    with pytest.raises(OSError):
        cache.get(bad)
    bad.CopyFrom(staging.desc)
    bad.kind = "cuda"
    with pytest.raises(OSError):
        cache.get(bad)
    staging.close()


def offer(transports, host="h", kind="cuda", forced=False):
    o = make_offer("grpc", CPU)
    del o.transports[:]
    o.transports.extend(transports)
    o.host_id, o.device_kind, o.forced = host, kind, forced
    return o


@pytest.mark.parametrize(
    "off, mode, local_kind, unavailable, want, fallback, error",
    [
        (offer(["cuda-ipc", "grpc"]), "auto", "cuda", "", "cuda-ipc", False, ""),
        (offer(["cuda-ipc", "grpc"], host="other"), "auto", "cuda", "", "grpc", False, ""),
        (offer(["cuda-ipc", "grpc"]), "auto", "cuda", "no memory", "grpc", True, ""),
        (offer(["cuda-ipc", "grpc"], kind="cpu"), "auto", "cuda", "", "grpc", True, ""),
        (offer(["grpc"], kind="cpu"), "auto", "cpu", "", "grpc", False, ""),
        (offer(["cuda-ipc", "grpc"]), "grpc", "cuda", "", "grpc", False, ""),
        (offer(["cuda-ipc"], forced=True), "auto", "cpu", "", "cuda-ipc", False, ""),  # shm test path
        (offer(["cuda-ipc"], host="other", forced=True), "auto", "cuda", "", "", False, "different hosts"),
        (offer(["grpc"], forced=True), "cuda-ipc", "cuda", "", "", False, "decode offers only"),
        (offer(["cuda-ipc"], forced=True), "grpc", "cuda", "", "", False, "forced to grpc"),
        (offer(["cuda-ipc", "grpc"]), "cuda-ipc", "cuda", "no memory", "", False, "no memory"),
        (None, "auto", "cuda", "", "grpc", False, ""),  # an old decode without an offer
    ],
)
def test_choose(off, mode, local_kind, unavailable, want, fallback, error):
    c = choose(off, mode, "h", local_kind, unavailable)
    assert (c.transport, c.fallback) == (want, fallback)
    assert (error in c.error) if error else not c.error


def test_offer_on_cpu():
    assert list(make_offer("auto", CPU).transports) == ["grpc"]
    o = make_offer("cuda-ipc", CPU)
    assert list(o.transports) == ["cuda-ipc"] and o.forced and o.host_id
