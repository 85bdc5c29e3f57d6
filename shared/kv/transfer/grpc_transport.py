"""`grpc` transport: page bytes travel in the Prefill stream's messages (any two hosts).

Sender: a chunk's rows (gathered on the device by the engine) are copied device -> host in one copy into a
pinned buffer on a side CUDA stream; each message carries up to `max_batch_bytes` of rows, checksummed with
hardware CRC32C and serialized with the payload copied once (`wire.batch_message_bytes`). With a `pool`, the
messages are built by its threads, a few ahead of the stream writer (CRC32C and the copy release the GIL), so
building message i+1 overlaps gRPC sending message i instead of preceding the chunk's first message.
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


_Job = tuple[int, list[int], list[int], memoryview, LayerRange | None]  # (first seq_no, pages, tokens, payload, layers)


class GrpcSender(KVSender):
    transport = GRPC

    def __init__(self, *args, pool: Executor | None = None, lookahead: int = 4, **kw):
        super().__init__(*args, **kw)
        self.pool = pool  # builds messages ahead of the writer (None: each when the writer asks for it)
        self.lookahead = max(1, lookahead)

    def send(self, exported: ExportedPages) -> Iterator[bytes]:
        """Books every batch of the chunk now (seq_nos, page states), copies the rows to the host now, and returns
        the messages as an iterator that builds them (checksum + serialization) as the writer takes them. A layer
        group's rows are copied after its `ready` event, while the engine's forward computes the next layers."""
        self.wait_ready(exported)  # the transfer's clock starts once the rows exist on the device
        span = self.clock.start()
        host = to_host(exported)  # [N, page_bytes]
        exported.host = host
        jobs: list[_Job] = []
        n, k, layers = len(exported.page_indexes), self.rows_per(exported), self.layers_of(exported)
        for i in range(0, n, k):
            payload = memoryview(host[i : i + k].numpy()).cast("B")  # type: ignore[arg-type]
            idx, tok = exported.page_indexes[i : i + k], exported.num_tokens[i : i + k]
            jobs.append((self._shipped(idx, payload.nbytes, span, layers), idx, tok, payload, layers))
        return self._messages(jobs)

    def _message(self, job: _Job) -> bytes:
        first, idx, tok, payload, layers = job
        return batch_message_bytes(self._header(first, idx, tok, payload, layers), payload)

    def _messages(self, jobs: list[_Job]) -> Iterator[bytes]:
        """The first `lookahead` messages start building now; each one taken starts the next."""
        if self.pool is None:
            return map(self._message, jobs)
        pool = self.pool
        pending = iter(jobs)
        ahead: deque[Future] = deque(pool.submit(self._message, j) for j in islice(pending, self.lookahead))

        def taken() -> Iterator[bytes]:
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
