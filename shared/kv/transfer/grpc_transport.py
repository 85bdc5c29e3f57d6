"""`grpc` transport: page bytes travel in the Prefill stream's messages (any two hosts).

Sender: a chunk's rows (gathered on the device by the engine) are copied device -> host in one copy into a
pinned buffer on a side CUDA stream; each message carries up to `max_batch_bytes` of rows, checksummed with
hardware CRC32C and serialized with the payload copied once (`wire.batch_message_bytes`).
Receiver: the payload is a view of the received bytes (no copy), verified (sizes, ids, seq, CRC32C), copied
host -> device in one copy, and written into the pool by one scatter on the engine thread.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from pdserve.errors import CorruptPage
from pdserve.kv.transfer.base import ExportedPages, KVReceiver, KVSender
from pdserve.kv.transfer.handshake import GRPC
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


def host_view(buf: Any) -> torch.Tensor:
    """A uint8 CPU tensor over a (read-only) buffer, without copying it. Readers only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": nothing writes to it
        return torch.frombuffer(buf, dtype=torch.uint8)


class GrpcSender(KVSender):
    transport = GRPC

    def send(self, exported: ExportedPages) -> list[Any]:
        span = self.clock.start()
        host = to_host(exported)  # [N, page_bytes]
        exported.host = host
        msgs: list[Any] = []
        n, k = len(exported.page_indexes), self.rows_per_batch
        for i in range(0, n, k):
            rows = host[i : i + k]
            payload = memoryview(rows.numpy()).cast("B")  # type: ignore[arg-type]
            idx, tok = exported.page_indexes[i : i + k], exported.num_tokens[i : i + k]
            first = self._shipped(idx, payload.nbytes, span)
            msgs.append(batch_message_bytes(self._header(first, idx, tok, payload), payload))
        return msgs


class GrpcReceiver(KVReceiver):
    transport = GRPC

    def _fetch(self, header: kv_pb2.KVBatchHeader, source: Any) -> torch.Tensor:
        if not isinstance(source, memoryview):
            raise CorruptPage(f"{type(source).__name__} received on the grpc transport")
        verify_header(header, self.expect, source)  # sizes and CRC32C before any use of the bytes
        rows = host_view(source).view(len(header.page_indexes), self.fmt.page_bytes)
        if self.device.type != "cuda":
            return rows
        dst = torch.empty(rows.shape, dtype=torch.uint8, device=self.device)  # on the engine's stream's pool
        stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(stream):
            dst.copy_(rows, non_blocking=True)
        stream.synchronize()
        return dst
