"""`cuda-ipc` transport (same host): control on the Prefill stream, bytes device to device.

Prefill registers one staging buffer per process (`IpcStaging`, its CUDA IPC handle exported once and sent in
every cuda-ipc `KVTransportChoice`). Per chunk it reserves a region of the buffer, copies the chunk's rows into
it on a side stream, waits for the copy, and sends one `KVIpcBatch` descriptor (offset, header) per region.
Decode opens the buffer once (cached by `buffer_id` in `IpcBufferCache`), copies the region into its own memory
(peer to peer), acks, and scatters the rows into its pool on the engine thread. An ack gives the region back;
decode reads the stream in order, so PrefillDone follows the last descriptor at once, and the Prefill RPC stays
open until every region is acked (`drain`): no region is reused while decode reads it.

The copier is injected: `CudaIpcCopier` on CUDA (torch's `_share_cuda_` / `_new_shared_cuda`, no pickle);
`ShmCopier` on CPU moves the bytes through a shared-memory file, so the whole protocol runs in CPU tests.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from pdserve.errors import CorruptPage
from pdserve.kv.transfer.base import ExportedPages, KVReceiver, KVSender
from pdserve.kv.transfer.device_copy import copy_to_device
from pdserve.kv.transfer.handshake import CUDA_IPC
from pdserve.v1 import internal_pb2, kv_pb2

ALIGN = 512  # region offsets (bytes)


# ---- copiers ------------------------------------------------------------------------------------------------
class DeviceCopier(ABC):
    """How bytes move between two processes' device memory."""

    kind: str = ""

    @abstractmethod
    def register(self, nbytes: int) -> tuple[torch.Tensor, kv_pb2.KVIpcBuffer]:
        """Sender, once: allocate a uint8 [nbytes] buffer and describe how another process opens it."""

    @abstractmethod
    def stage(self, region: torch.Tensor, exported: ExportedPages, rows: torch.Tensor) -> None:
        """Sender: copy `rows` (part of `exported.rows`) into `region`; complete when this returns."""

    @abstractmethod
    def open(self, desc: kv_pb2.KVIpcBuffer) -> torch.Tensor:
        """Receiver, once per buffer: the peer's buffer as a uint8 [nbytes] tensor."""

    @abstractmethod
    def fetch(self, region: torch.Tensor) -> torch.Tensor:
        """Receiver: copy a region of an opened buffer into memory of its own; complete when this returns."""

    def close(self) -> None:
        """Sender: release what `register` made outside the process (files)."""
        return None


class CudaIpcCopier(DeviceCopier):
    """CUDA IPC handles of a caching-allocator block (torch's own sharing primitives, no pickle)."""

    kind = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self._fetch_stream: torch.cuda.Stream | None = None  # receiver copies (`device_copy`): one stream's blocks

    def register(self, nbytes: int) -> tuple[torch.Tensor, kv_pb2.KVIpcBuffer]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        storage = buf.untyped_storage()
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
        desc = kv_pb2.KVIpcBuffer(
            buffer_id=uuid.uuid4().hex,
            kind=self.kind,
            nbytes=nbytes,
            device_index=int(device),
            handle=handle,
            storage_size_bytes=size,
            storage_offset_bytes=offset,
            ref_counter_handle=ref_handle,
            ref_counter_offset=ref_offset,
            event_handle=event_handle or b"",
            event_sync_required=bool(event_sync),
        )
        return buf, desc

    def stage(self, region: torch.Tensor, exported: ExportedPages, rows: torch.Tensor) -> None:
        src = rows.reshape(-1)
        stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(stream):
            if exported.ready is not None and src.device.type == "cuda":
                stream.wait_event(exported.ready)  # the gather, queued on the engine's stream
            region.copy_(src, non_blocking=True)
            if src.device.type == "cuda":
                src.record_stream(stream)
        stream.synchronize()

    def open(self, desc: kv_pb2.KVIpcBuffer) -> torch.Tensor:
        # Open on this process's device: for a peer GPU, cudaIpcOpenMemHandle maps it through peer access.
        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            self.device.index if self.device.index is not None else torch.cuda.current_device(),
            desc.handle,
            desc.storage_size_bytes,
            desc.storage_offset_bytes,
            desc.ref_counter_handle,
            desc.ref_counter_offset,
            desc.event_handle or None,
            desc.event_sync_required,
        )
        t = torch.empty(0, dtype=torch.uint8, device=self.device)
        t.set_(storage, 0, (desc.nbytes,), (1,))
        return t

    def fetch(self, region: torch.Tensor) -> torch.Tensor:
        if self._fetch_stream is None:  # made on first use (a CPU test builds this copier only to be refused)
            self._fetch_stream = torch.cuda.Stream(device=self.device)
        return copy_to_device(region, self.device, self._fetch_stream)  # never the engine stream's blocks


class ShmCopier(DeviceCopier):
    """CPU stand-in for device memory: a shared-memory file both processes map (tests, CPU-only hosts)."""

    kind = "shm"

    def __init__(self, directory: str | None = None):
        self.directory = Path(directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
        self._files: list[Path] = []

    def register(self, nbytes: int) -> tuple[torch.Tensor, kv_pb2.KVIpcBuffer]:
        buffer_id = uuid.uuid4().hex
        path = self.directory / f"pdserve-kv-{buffer_id}"
        buf = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        self._files.append(path)
        return buf, kv_pb2.KVIpcBuffer(buffer_id=buffer_id, kind=self.kind, nbytes=nbytes, path=str(path))

    def stage(self, region: torch.Tensor, exported: ExportedPages, rows: torch.Tensor) -> None:
        region.copy_(rows.reshape(-1))

    def open(self, desc: kv_pb2.KVIpcBuffer) -> torch.Tensor:
        path = Path(desc.path)
        if path.parent != self.directory or not path.name.startswith("pdserve-kv-") or not path.is_file():
            raise OSError(f"not a pdserve shared-memory buffer: {desc.path!r}")
        if path.stat().st_size < desc.nbytes:
            raise OSError(f"shared-memory buffer {desc.path} is smaller than {desc.nbytes} bytes")
        return torch.from_file(str(path), shared=True, size=desc.nbytes, dtype=torch.uint8)

    def fetch(self, region: torch.Tensor) -> torch.Tensor:
        return region.clone()

    def close(self) -> None:
        for p in self._files:
            p.unlink(missing_ok=True)
        self._files = []


def copier_for(device: torch.device) -> DeviceCopier:
    return CudaIpcCopier(device) if device.type == "cuda" else ShmCopier()


# ---- sender side --------------------------------------------------------------------------------------------
class IpcStaging:
    """Prefill's registered staging buffer (one per process) and a first-fit allocator of its regions."""

    def __init__(self, copier: DeviceCopier, nbytes: int):
        self.copier = copier
        self.buffer, self.desc = copier.register(nbytes)
        self.nbytes = nbytes
        self._cv = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, length), sorted by offset
        self.in_use = 0

    def reserve(self, nbytes: int, timeout: float) -> int:
        """Offset of a free region of `nbytes`; waits for releases up to `timeout` (TimeoutError)."""
        need = -(-nbytes // ALIGN) * ALIGN
        if need > self.nbytes:
            raise ValueError(f"region of {nbytes} bytes exceeds the {self.nbytes}-byte staging buffer")
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                for i, (off, length) in enumerate(self._free):
                    if length >= need:
                        self._free[i : i + 1] = [(off + need, length - need)] if length > need else []
                        self.in_use += need
                        return off
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {nbytes}-byte staging region free within {timeout}s")
                self._cv.wait(left)

    def release(self, offset: int, nbytes: int) -> None:
        need = -(-nbytes // ALIGN) * ALIGN
        with self._cv:
            self._free.append((offset, need))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, length in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((off, length))
            self._free = merged
            self.in_use -= need
            self._cv.notify_all()

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]

    def close(self) -> None:
        self.copier.close()


class IpcSender(KVSender):
    transport = CUDA_IPC
    device_to_device = True

    def __init__(self, *args, staging: IpcStaging, reserve_timeout: float, **kw):
        super().__init__(*args, **kw)
        self.staging = staging
        self.reserve_timeout = reserve_timeout
        self.rows_per_batch = max(1, min(self.rows_per_batch, staging.nbytes // 2 // self.fmt.page_bytes))
        self._regions: list[tuple[int, int, int]] = []  # (last seq_no, offset, nbytes) not yet acked
        self._cv = threading.Condition()

    def rows_per(self, exported: ExportedPages) -> int:
        """At most half the staging buffer per region."""
        return self.rows_within(exported, self.staging.nbytes)

    def send(self, exported: ExportedPages) -> list[Any]:
        """Per region: reserve, copy the rows in after `exported.ready` (a layer group's: while the forward computes
        the next layers), book, describe."""
        msgs: list[Any] = []
        self.wait_ready(exported)  # the transfer's clock starts once the rows exist on the device
        n, k, layers = len(exported.page_indexes), self.rows_per(exported), self.layers_of(exported)
        for i in range(0, n, k):
            rows = exported.rows[i : i + k]
            nbytes = rows.numel()
            offset = self.staging.reserve(nbytes, self.reserve_timeout)
            span = self.clock.start()
            try:
                self.staging.copier.stage(self.staging.region(offset, nbytes), exported, rows)
                idx, tok = exported.page_indexes[i : i + k], exported.num_tokens[i : i + k]
                first = self._shipped(idx, nbytes, span, layers)
            except BaseException:
                self.staging.release(offset, nbytes)
                raise
            with self._cv:
                self._regions.append((first + len(idx) - 1, offset, nbytes))
            header = self._header(first, idx, tok, layers=layers)
            batch = kv_pb2.KVIpcBatch(header=header, offset=offset, buffer_id=self.staging.desc.buffer_id)
            msgs.append(internal_pb2.PrefillServerMessage(ipc_batch=batch))
        return msgs

    def _acked(self, seq_no: int) -> None:
        with self._cv:
            done = [r for r in self._regions if r[0] <= seq_no]
            self._regions = [r for r in self._regions if r[0] > seq_no]
            self._cv.notify_all()
        for _, offset, nbytes in done:
            self.staging.release(offset, nbytes)

    def _release_all(self) -> None:
        # The stream is over: decode gets no PrefillDone, so whatever it copied from these regions is discarded.
        with self._cv:
            regions, self._regions = self._regions, []
        for _, offset, nbytes in regions:
            self.staging.release(offset, nbytes)


# ---- receiver side ------------------------------------------------------------------------------------------
class IpcBufferCache:
    """Decode's opened peer buffers by buffer_id (each opened once per process)."""

    def __init__(self, copier: DeviceCopier):
        self.copier = copier
        self._lock = threading.Lock()
        self._open: dict[str, tuple[kv_pb2.KVIpcBuffer, torch.Tensor]] = {}
        self.opens = 0  # how many times a handle was actually opened (tests: once per buffer)

    def get(self, desc: kv_pb2.KVIpcBuffer) -> torch.Tensor:
        """The opened buffer; raises (OSError, RuntimeError, ...) when it cannot be opened."""
        if desc.kind != self.copier.kind:
            raise OSError(f"peer buffer kind {desc.kind!r}; this process moves {self.copier.kind!r} buffers")
        with self._lock:
            hit = self._open.get(desc.buffer_id)
            if hit is not None:
                return hit[1]
            buf = self.copier.open(desc)
            self._open[desc.buffer_id] = (desc, buf)
            self.opens += 1
            return buf

    def buffer(self, buffer_id: str) -> torch.Tensor | None:
        with self._lock:
            hit = self._open.get(buffer_id)
            return None if hit is None else hit[1]


class IpcReceiver(KVReceiver):
    transport = CUDA_IPC

    def __init__(self, *args, buffers: IpcBufferCache, buffer_id: str, **kw):
        super().__init__(*args, **kw)
        self.buffers = buffers
        self.buffer_id = buffer_id

    def _fetch(self, header: kv_pb2.KVBatchHeader, source: Any) -> torch.Tensor:
        if not isinstance(source, kv_pb2.KVIpcBatch):
            raise CorruptPage(f"{type(source).__name__} received on the cuda-ipc transport")
        if source.buffer_id != self.buffer_id:
            raise CorruptPage(f"batch names buffer {source.buffer_id!r}, the stream agreed on {self.buffer_id!r}")
        buf = self.buffers.buffer(self.buffer_id)
        if buf is None:
            raise CorruptPage(f"peer buffer {self.buffer_id!r} is not open")
        end = source.offset + header.nbytes
        if source.offset % ALIGN or end > buf.numel():
            raise CorruptPage(f"region [{source.offset}, {end}) outside the peer's {buf.numel()}-byte buffer")
        rows = self.buffers.copier.fetch(buf[source.offset : end])
        return rows.view(len(header.page_indexes), -1)  # [N, row bytes] (verified: all layers, or a group's)
