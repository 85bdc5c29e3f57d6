"""`grpc-shm` transport: control on the Prefill stream, bytes through the shippers (`pdserve.kv.shipper`).

Each end runs `--kv-shippers` shippers (`ShipperGroup`): consecutive batches take different ones, so the bytes move
through several processes' gRPC at once. Sender: per batch, the chunk's rows go into a block of one shipper's arena
(a memfd that shipper maps too; pinned on CUDA, so the copy off the device is one DMA), the header is checksummed
there (CRC32C, outside the GIL), that shipper is told to push the block to one of decode's shippers under the
transfer key decode offered, and the stream carries a `KVShippedBatch` descriptor (the header). Blocks are given
back when decode acknowledges them. Receiver: each descriptor is scheduled once its batch landed in the arena of
whichever decode shipper it came through (`Inbox.when`: no copy thread waits for bytes still on their way); then
the header is verified against the landed bytes (sizes, CRC32C), the rows are copied out (on CUDA one DMA from the
pinned arena, into this process's memory) and the region goes back to that shipper. The engine processes touch
each byte once (the copy and the checksum, both outside the GIL); gRPC's copies run in the shippers.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.errors import CorruptPage, PeerUnavailable
from pdserve.kv.shipper.group import ShipperGroup
from pdserve.kv.shipper.link import Inbox, ShipperDown
from pdserve.kv.transfer.base import ExportedPages, KVReceiver, KVSender
from pdserve.kv.transfer.device_copy import copy_to_device
from pdserve.kv.transfer.modes import GRPC_SHM
from pdserve.kv.transfer.wire import verify_header
from pdserve.server.security import (
    ENV_TLS_CA,
    ENV_TLS_CERT,
    ENV_TLS_KEY,
    ENV_TLS_SERVER_NAME,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    ServiceSecurity,
)
from pdserve.v1 import internal_pb2, kv_pb2


class ShmSender(KVSender):
    transport = GRPC_SHM

    def __init__(
        self, *args, link: ShipperGroup, addresses: list[str], key: bytes, reserve_timeout: float, **kw
    ) -> None:
        super().__init__(*args, **kw)
        self.link = link
        self.addresses = addresses  # decode's shippers (prefill's shipper k pushes to addresses[k % len])
        self.key = key  # decode's name for this transfer
        self.reserve_timeout = reserve_timeout
        self._blocks: list[tuple[int, Any]] = []  # (last seq_no, arena block) not yet acknowledged
        self._failed = ""
        self._stream: torch.cuda.Stream | None = None  # device -> arena copies
        link.watch(key, self._fail)

    def rows_per(self, exported: ExportedPages) -> int:
        """At most half a shipper's arena per batch."""
        return self.rows_within(exported, self.link.arena_bytes)

    def _fail(self, reason: str) -> None:
        with self._acked_cv:
            self._failed = self._failed or reason
            self._acked_cv.notify_all()

    def failure(self) -> str:
        return self._failed

    def _stage(self, block: torch.Tensor, exported: ExportedPages, rows: torch.Tensor) -> None:
        """rows (on the engine's device) -> the arena block; complete when this returns."""
        src = rows.reshape(-1)
        if src.device.type != "cuda":
            block.copy_(src)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=src.device)
        with torch.cuda.stream(self._stream):
            if exported.ready is not None:
                self._stream.wait_event(exported.ready)  # the gather, queued on the engine's stream
            block.copy_(src, non_blocking=True)
            src.record_stream(self._stream)
        self._stream.synchronize()

    def send(self, exported: ExportedPages) -> list[Any]:
        """Per batch: a block, the rows in (after `exported.ready`), booked, checksummed, pushed, described."""
        if self._failed:
            raise PeerUnavailable(self._failed)
        self.wait_ready(exported)  # the transfer's clock starts once the rows exist on the device
        msgs: list[Any] = []
        n, k, layers = len(exported.page_indexes), self.rows_per(exported), self.layers_of(exported)
        for i in range(0, n, k):
            rows = exported.rows[i : i + k]
            nbytes = rows.numel()
            block = self.link.reserve(nbytes, self.reserve_timeout)
            span = self.clock.start()
            try:
                region = block.tensor[:nbytes]  # in the arena of the shipper that pushes it
                self._stage(region, exported, rows)
                idx, tok = exported.page_indexes[i : i + k], exported.num_tokens[i : i + k]
                first = self._shipped(idx, nbytes, span, layers)
                with self._acked_cv:
                    self._blocks.append((first + len(idx) - 1, block))
                header = self._header(first, idx, tok, memoryview(region.numpy()), layers)  # type: ignore[arg-type]
                self.link.push(self.addresses, self.key, first, block, nbytes)
            except ShipperDown as e:
                raise PeerUnavailable(str(e)) from e
            except BaseException:
                with self._acked_cv:
                    held = any(b is block for _, b in self._blocks)
                if not held:
                    self.link.give(block)
                raise
            msgs.append(internal_pb2.PrefillServerMessage(shipped_batch=kv_pb2.KVShippedBatch(header=header)))
        return msgs

    def _acked(self, seq_no: int) -> None:
        with self._acked_cv:
            done = [b for last, b in self._blocks if last <= seq_no]
            self._blocks = [(last, b) for last, b in self._blocks if last > seq_no]
        for block in done:
            self.link.give(block)

    def drain(self, timeout: float) -> None:
        super().drain(timeout)
        if self._failed:
            raise PeerUnavailable(self._failed)

    def _drain_stop(self) -> bool:
        return bool(self._failed)

    def _release_all(self) -> None:
        # The stream is over: decode gets no PrefillDone, so whatever is still on its way is discarded there.
        self.link.unwatch(self.key)
        with self._acked_cv:
            blocks, self._blocks = [b for _, b in self._blocks], []
        for block in blocks:
            self.link.give(block)


@dataclass
class _Queued:
    """A batch's fetch-and-check, waiting for its bytes (or for an earlier batch's) before it is scheduled."""

    header: kv_pb2.KVBatchHeader
    work: Callable[[], None]
    landed: bool = False


class ShmReceiver(KVReceiver):
    transport = GRPC_SHM
    copy_stream: torch.cuda.Stream | None = None  # the arena -> device copies' side stream (the connector's)

    def __init__(self, *args, inbox: Inbox, **kw):
        super().__init__(*args, **kw)
        self.inbox = inbox
        self._order_lock = threading.Lock()
        self._queued: deque[_Queued] = deque()  # in descriptor order, not yet scheduled

    def _schedule(self, header: kv_pb2.KVBatchHeader, work) -> None:
        """Once the batch's bytes landed (or a shipper failed): no copy thread waits for bytes on their way. And in
        descriptor order: batches spread over several shippers land in any order, while each batch's work waits for
        the one scheduled before it (`receive_async`), so one scheduled ahead of an earlier batch would hold a copy
        thread that the earlier one may need."""
        queued = _Queued(header, work)
        with self._order_lock:
            self._queued.append(queued)
        self.inbox.when(header.first_seq_no, lambda: self._landed(queued))

    def _landed(self, queued: _Queued) -> None:
        with self._order_lock:  # held while scheduling, so two shippers' event threads keep the order
            queued.landed = True
            while self._queued and self._queued[0].landed:
                head = self._queued.popleft()
                super()._schedule(head.header, head.work)

    def _fetch(self, header: kv_pb2.KVBatchHeader, source: Any) -> torch.Tensor:
        if not isinstance(source, kv_pb2.KVShippedBatch):
            raise CorruptPage(f"{type(source).__name__} received on the grpc-shm transport")
        try:
            landed = self.inbox.take(header.first_seq_no)
        except ShipperDown as e:
            raise PeerUnavailable(f"KV batch {header.first_seq_no} did not arrive: {e}") from e
        try:
            if landed.nbytes != header.nbytes:
                raise CorruptPage(f"batch {header.first_seq_no}: {landed.nbytes} bytes landed, header: {header.nbytes}")
            payload = memoryview(landed.tensor.numpy())  # type: ignore[arg-type]
            verify_header(header, self.expect, payload)  # sizes and CRC32C
            rows = landed.tensor.view(len(header.page_indexes), -1)  # [N, row bytes]
            if self.device.type != "cuda":
                return rows.clone()  # the region goes back to the shipper below
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(device=self.device)
            return copy_to_device(rows, self.device, self.copy_stream)  # complete when it returns
        finally:
            self.inbox.release(landed)


def shipper_wanted(cfg, device: torch.device) -> bool:
    """Whether this process runs a shipper: `--kv-shipper on`, or auto with CUDA, or `--kv-transport grpc-shm`."""
    mode = getattr(cfg, "kv_shipper", "off")
    return cfg.kv_transport == GRPC_SHM or mode == "on" or (mode == "auto" and device.type == "cuda")


def start_shipper(cfg, role: str, device: torch.device) -> ShipperGroup | None:
    """This process's `--kv-shippers` shippers (None when not wanted), sharing `--kv-shipper-arena-mb`. Their
    environment carries the service's resolved internal token and TLS files (their Push ports are internal; their
    pushes carry them)."""
    if not shipper_wanted(cfg, device):
        return None
    environ = dict(os.environ)
    if hasattr(cfg, "tls_cert"):  # a service's config (tests and benches hand a bare namespace)
        sec = ServiceSecurity.of(cfg)
        environ.pop(ENV_TOKEN_FILE, None)
        environ.pop(ENV_TOKEN, None)
        if sec.token:
            environ[ENV_TOKEN] = sec.token
        tls = {ENV_TLS_CERT: sec.tls.cert, ENV_TLS_KEY: sec.tls.key, ENV_TLS_CA: sec.tls.ca}
        environ.update({k: v for k, v in {**tls, ENV_TLS_SERVER_NAME: sec.tls.server_name}.items() if v})
    group = ShipperGroup.of(
        role,
        getattr(cfg, "kv_shippers", 1),
        int(getattr(cfg, "kv_shipper_arena_mb", 512.0) * 2**20),
        pin=device.type == "cuda",
        host=getattr(cfg, "host", "127.0.0.1"),
        port=getattr(cfg, "kv_shipper_port", 0),
        environ=environ,
    )
    return group.start()
