"""The grpc sender's pipeline: a chunk's first batches ramp up to the batch bound (every row once, in order, the
receiver none the wiser), and a batch is built only once its rows' device -> host copy has landed."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer import ExportedPages, ReceiverPages, SenderPages
from pdserve.kv.transfer.grpc_transport import GrpcReceiver, GrpcSender, batch_spans
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.stats import TransferStats
from pdserve.kv.transfer.wire import BatchExpectation, parse_server_message, verify_header

INT8 = KVLayoutSpec("int8", page_size=4, num_layers=2, num_kv_heads=2, head_dim=16, group_size=8)
FMT = PageFormat(INT8)


def rows_of(n: int) -> torch.Tensor:
    """uint8 [n, page_bytes]: random int8 data, scales 1.0 (values the receiver accepts)."""
    rows = torch.randint(0, 256, (n, FMT.page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    rows[:, FMT.data_bytes :].view(torch.float16).fill_(1.0)
    return rows


@pytest.mark.parametrize(
    "n, k, ramp, floor, sizes",
    [
        (40, 8, 0, 1, [8] * 5),  # no ramp: the bound
        (40, 8, 2, 1, [2, 4, 8, 8, 8, 8, 2]),  # a quarter, a half, then the bound
        (40, 8, 3, 1, [1, 2, 4, 8, 8, 8, 8, 1]),
        (40, 8, 3, 3, [3, 3, 4, 8, 8, 8, 6]),  # none under the floor
        (40, 8, 2, 100, [8] * 5),  # a floor above the bound: the bound
        (3, 8, 2, 1, [2, 1]),  # fewer rows than the ramp
        (5, 1, 3, 1, [1] * 5),
        (0, 8, 2, 1, []),
    ],
)
def test_batch_spans_ramp_up_to_the_bound_and_cover_every_row_once(n, k, ramp, floor, sizes):
    spans = list(batch_spans(n, k, ramp, floor))
    assert [j - i for i, j in spans] == sizes
    edges = [0, *[j for _, j in spans]]
    assert [(i, j) for i, j in spans] == list(zip(edges, edges[1:])) and edges[-1] == n  # adjacent, all rows


@pytest.mark.parametrize("threads", [0, 2], ids=["inline", "pool"])
def test_ramped_batches_reach_the_receiver_whole_and_in_order(threads):
    n = 20
    rows = rows_of(n)
    imported: list = []

    def import_rows(idx, tok, r, layers=None) -> Future:
        imported.append((idx, r.clone()))
        f: Future = Future()
        f.set_result(None)
        return f

    pool = ThreadPoolExecutor(threads) if threads else None
    sender = GrpcSender(
        SenderPages("r", n), INT8, "fp", TransferStats(), max_batch_bytes=8 * FMT.page_bytes, pool=pool,
        lookahead=threads, ramp=2, ramp_floor_bytes=1,
    )  # fmt: skip
    recv = GrpcReceiver(ReceiverPages("r", n), BatchExpectation(INT8, "fp", "r"), TransferStats(), torch.device("cpu"),
                        import_rows)  # fmt: skip
    acks = []
    for raw in sender.send(ExportedPages(list(range(n)), [4] * n, rows)):
        _, header, payload = parse_server_message(raw)
        acks.append(recv.receive(header, payload))
    if pool is not None:
        pool.shutdown()
    assert [len(idx) for idx, _ in imported] == [2, 4, 8, 6]  # the ramp, then the bound
    assert acks == [1, 5, 13, 19]
    assert [i for idx, _ in imported for i in idx] == list(range(n))
    assert torch.equal(torch.cat([r for _, r in imported]), rows)
    recv.finish(n, timeout=5)
    assert sender.ack(acks[-1]) is True  # every page acknowledged: freed


class LandingCopy:
    """A device -> host copy still in flight: its bytes land in the host rows when the builder waits for it."""

    def __init__(self, host: torch.Tensor, src: torch.Tensor):
        self.host, self.src, self.waited = host, src, 0

    def synchronize(self) -> None:
        self.host.copy_(self.src)
        self.waited += 1


def test_a_batch_is_built_only_after_its_rows_copy_landed():
    n = 4
    src = rows_of(n)
    host = torch.zeros_like(src)  # the pinned buffer before the copy lands
    sender = GrpcSender(SenderPages("r", n), INT8, "fp", TransferStats(), max_batch_bytes=n * FMT.page_bytes)
    copy = LandingCopy(host, src)
    idx, tok = list(range(n)), [4] * n
    first = sender.pages.ship(idx, host.numel())
    payload = memoryview(host.numpy()).cast("B")
    raw = sender._message((first, idx, tok, payload, None, copy))
    assert copy.waited == 1
    _, header, view = parse_server_message(raw)
    verify_header(header, BatchExpectation(INT8, "fp", "r"), view)  # the checksum covers the landed bytes
    assert bytes(view) == src.numpy().tobytes()
