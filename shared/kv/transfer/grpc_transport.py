"""`grpc` transport: page bytes travel in the Prefill stream's messages (any two hosts).

Sender: a chunk's rows (gathered on the device by the engine) are copied device -> host into one pinned buffer on a
side CUDA stream, batch by batch (an event after each); each message carries up to `max_batch_bytes` of rows,
checksummed with hardware CRC32C and serialized with the payload copied once (`wire.batch_message_bytes`). With a
`pool`, the messages are built by its threads, a few ahead of the stream writer (CRC32C and the copy release the
GIL), so building message i+1 overlaps gRPC sending message i. The wire idles only while a chunk's first message is
built (the writer asks for it when the previous chunk's last one went out), so a chunk's first batches are smaller
(`batch_spans`' ramp: 1/4, 1/2 of the bound) and the writer builds the first itself, without two thread handoffs.
Receiver: the payload is a view of the received bytes (no copy), verified (sizes, ids, seq, CRC32C), on CUDA copied
into pinned host memory (outside the GIL) and from there to the device in one DMA, and written into the pool by one
scatter on the engine thread. With the receiver's `pool` (`KVReceiver.receive_async`), batches are checked and
copied on its threads while the stream's reader takes the next message: batch i's CRC32C overlaps batch i+1's
copy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from itertools import islice
from typing import Any

import torch

from pdserve.errors import CorruptPage
from pdserve.kv.bytes_out import copy_into, tensor_view
from pdserve.kv.transfer.base import ExportedPages, KVReceiver, KVSender
from pdserve.kv.transfer.device_copy import copy_to_device
from pdserve.kv.transfer.handshake import GRPC
from pdserve.kv.transfer.layers import LayerRange
from pdserve.kv.transfer.wire import batch_message_bytes, verify_header
from pdserve.v1 import kv_pb2


def to_host(exported: ExportedPages) -> torch.Tensor:
    """The rows on the host: as they are on CPU; else one device -> pinned host copy on a side stream."""
    rows = exported.rows
    if rows.device.type != "cuda":
        return rows.contiguous()
    host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(device=rows.device)
    with torch.cuda.stream(stream):
        if exported.ready is not None:
            stream.wait_event(exported.ready)  # the gather, queued on the engine's stream
        host.copy_(rows, non_blocking=True)
        rows.record_stream(stream)
    stream.synchronize()
    return host


def to_host_async(exported: ExportedPages, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, list[Any]]:
    """The rows on the host, copied span by span: (rows [N, page_bytes], per span the event after its copy, or
    None when ready now). On CUDA one pinned buffer, filled on a side stream in span order: a chunk's first batch
    waits for its own rows only, not for the whole chunk's copy."""
    rows = exported.rows
    if rows.device.type != "cuda":
        return rows.contiguous(), [None] * len(spans)
    host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream(device=rows.device)
    events = []
    with torch.cuda.stream(stream):
        if exported.ready is not None:
            stream.wait_event(exported.ready)  # the gather, queued on the engine's stream
        for i, j in spans:
            host[i:j].copy_(rows[i:j], non_blocking=True)
            events.append(torch.cuda.Event())
            events[-1].record(stream)
        rows.record_stream(stream)
    return host, events


def batch_spans(n: int, k: int, ramp: int = 0, floor: int = 1) -> Iterator[tuple[int, int]]:
    """[start, stop) row ranges of a chunk's n rows in batches of up to k rows. With `ramp`, the first batches are
    k/2^ramp, ..., k/2 rows (none under `floor`): the stream writer waits for a chunk's first message to be built
    (checksum and copy) while the wire idles, and a small first message shortens that wait, while the larger ones
    are built on the pool as the smaller ones are sent."""
    start, step = 0, 0
    while start < n:
        size = min(k, max(k >> max(0, ramp - step), floor, 1))
        yield start, min(n, start + size)
        start, step = start + size, step + 1


# (first seq_no, pages, tokens, payload, layers, the event after the payload's device -> host copy or None)
_Job = tuple[int, list[int], list[int], memoryview, LayerRange | None, Any]


class GrpcSender(KVSender):
    transport = GRPC

    def __init__(
        self,
        *args,
        pool: Executor | None = None,
        lookahead: int = 4,
        ramp: int = 2,
        ramp_floor_bytes: int = 1 << 19,
        **kw,
    ):
        super().__init__(*args, **kw)
        self.pool = pool  # builds messages ahead of the writer (None: each when the writer asks for it)
        self.lookahead = max(1, lookahead)
        self.ramp = max(0, ramp)  # the first `ramp` batches of a chunk grow by halves up to the bound
        self.ramp_floor_bytes = ramp_floor_bytes  # ... none below this size (more messages cost more than they hide)

    def send(self, exported: ExportedPages) -> Iterator[bytes]:
        """Books every batch of the chunk now (seq_nos, page states), queues the rows' copy to the host now, and
        returns the messages as an iterator that builds them (checksum + serialization) as the writer takes them,
        each once its rows are on the host. A layer group's rows are copied after its `ready` event, while the
        engine's forward computes the next layers."""
        self.wait_ready(exported)  # the transfer's clock starts once the rows exist on the device
        span = self.clock.start()
        k, layers = self.rows_per(exported), self.layers_of(exported)
        floor = -(-self.ramp_floor_bytes // max(1, exported.rows.shape[1]))  # rows of the smallest ramp batch
        spans = list(batch_spans(len(exported.page_indexes), k, self.ramp, floor))
        host, copied = to_host_async(exported, spans)  # [N, page_bytes]; complete once every job waited its event
        exported.host = host  # read (prompt cache) only after every message was built
        jobs: list[_Job] = []
        for (i, j), event in zip(spans, copied):
            payload = memoryview(host[i:j].numpy()).cast("B")  # type: ignore[arg-type]
            idx, tok = exported.page_indexes[i:j], exported.num_tokens[i:j]
            jobs.append((self._shipped(idx, payload.nbytes, span, layers), idx, tok, payload, layers, event))
        return self._messages(jobs)

    def _message(self, job: _Job) -> bytes:
        first, idx, tok, payload, layers, copied = job
        if copied is not None:
            copied.synchronize()  # its rows' device -> host copy (the GIL is released while waiting)
        return batch_message_bytes(self._header(first, idx, tok, payload, layers), payload)

    def _messages(self, jobs: list[_Job]) -> Iterator[bytes]:
        """The writer builds the first message itself when it asks for it (a pool thread's wake-up and the
        writer's own, each a GIL handoff, would only add to the wire's idle time); the next `lookahead` start
        building now, and each one taken starts the next."""
        if self.pool is None or not jobs:
            return map(self._message, jobs)
        pool = self.pool
        pending = iter(jobs[1:])
        ahead: deque[Future] = deque(pool.submit(self._message, j) for j in islice(pending, self.lookahead))

        def taken() -> Iterator[bytes]:
            yield self._message(jobs[0])
            while ahead:
                msg = ahead.popleft().result()
                for j in islice(pending, 1):
                    ahead.append(pool.submit(self._message, j))
                yield msg

        return taken()


class GrpcReceiver(KVReceiver):
    transport = GRPC
    copy_stream: torch.cuda.Stream | None = None  # the host -> device copies' side stream (the connector's)

    def _fetch(self, header: kv_pb2.KVBatchHeader, source: Any) -> torch.Tensor:
        if not isinstance(source, memoryview):
            raise CorruptPage(f"{type(source).__name__} received on the grpc transport")
        verify_header(header, self.expect, source)  # sizes and CRC32C before any use of the bytes
        rows = tensor_view(source).view(len(header.page_indexes), -1)  # [N, row bytes] (verified: all, or a group)
        if self.device.type != "cuda":
            return rows
        # Into pinned memory first (one memcpy outside the GIL), then one DMA: a copy from the received (pageable)
        # bytes goes through the driver's staging buffer, and pageable copies queue behind one another there, while
        # memcpys on the pool's threads run side by side (docs/benchmarks.md, KV transfer paths).
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)  # torch's pinned cache reuses blocks
        copy_into(host, source)
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(device=self.device)
        return copy_to_device(host, self.device, self.copy_stream)  # never the engine stream's blocks
