"""The KV transfer interface: one sender per request on prefill, one receiver per request on decode.

The servicers only wire a request to them:
- prefill: the engine thread exports a chunk's ready pages as one `ExportedPages` (page-major rows on the
  device, `page_format`), the stream writer calls `sender.send(exported)` and yields what it returns on the
  Prefill stream; the ack reader calls `sender.ack(seq_no)`; after PrefillDone the writer calls
  `sender.drain(timeout)` (the RPC stays open until it returns); when the RPC ends, `sender.close()`.
- decode: each batch message goes to `receiver.receive(header, source)`, which returns the seq_no to ack;
  `receiver.finish()` waits for the pool writes before the request joins the batch; `receiver.fail()` on any
  error frees the reserved pages.

Page states (`pages.SenderPages` / `ReceiverPages`) drive freeing on both ends. A transport is one file
(`grpc_transport.py`, `cuda_ipc.py`); a new one (e.g. NIXL/RDMA) subclasses KVSender / KVReceiver, adds its
descriptor message and its offer/choice fields (`handshake.py`).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv.codec import KVLayoutSpec, check_values
from pdserve.kv.transfer.layers import LayerRange
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.pages import ReceiverPages, SenderPages, TransferError
from pdserve.kv.transfer.stats import BusyClock, TransferStats
from pdserve.kv.transfer.wire import BatchExpectation, header_layers, make_header, verify_header
from pdserve.v1 import kv_pb2


@dataclass
class ExportedPages:
    """A chunk's ready pages (all layers, or one layer group of them), gathered by the engine into one buffer."""

    page_indexes: list[int]
    num_tokens: list[int]
    rows: torch.Tensor  # uint8 [N, page_bytes] on the engine's device (CPU for prompt-cache hits)
    ready: Any = None  # torch.cuda.Event recorded after the gather on the engine's stream (None: ready now)
    host: torch.Tensor | None = None  # a host copy, when the transport made one (the prompt cache reuses it)
    layers: LayerRange | None = None  # the layers the rows hold (PageFormat(layout, layers.count)); None: all

    @property
    def nbytes(self) -> int:
        return self.rows.numel()


# Import a batch into the pool: (page_indexes, num_tokens, rows uint8 [N, page_bytes] on the pool's device, the
# layers the rows hold: None for all) -> a Future of the engine-thread write.
ImportRows = Callable[[list[int], list[int], torch.Tensor, LayerRange | None], Future]


class KVSender(ABC):
    """Sending side of one request. `send` runs on the stream writer thread, `ack` on the ack reader."""

    transport: str = ""
    device_to_device = False  # bytes move device to device: a cached prefix goes from the engine's device copy

    def __init__(
        self,
        pages: SenderPages,
        layout: KVLayoutSpec,
        fingerprint: str,
        stats: TransferStats,
        max_batch_bytes: int,
    ):
        self.pages = pages
        self.layout = layout
        self.fmt = PageFormat(layout)
        self.fingerprint = fingerprint
        self.stats = stats
        self.max_batch_bytes = max_batch_bytes
        self.rows_per_batch = max(1, max_batch_bytes // self.fmt.page_bytes)  # whole pages per batch
        self.clock = BusyClock()
        self._spans: list[tuple[int, int]] = []  # unacked batches: (last seq_no, its clock span), in seq order
        self._lock = threading.Lock()
        self._acked_cv = threading.Condition(self._lock)
        self._acks_ended = False
        self._closed = False

    @abstractmethod
    def send(self, exported: ExportedPages) -> Iterable[Any]:
        """Ship the pages; returns the stream messages to yield (protobuf messages or pre-serialized bytes). Every
        batch is booked (seq_nos, page states) before this returns; the messages may be built as they are taken."""

    @staticmethod
    def wait_ready(exported: ExportedPages) -> None:
        """Block until the engine's gather of `exported` is done (its `ready` event). Senders start a batch's clock
        after it, so the transfer time counts the bytes' trip, not the compute before them: a layer group is handed
        over when the engine thread queued its gather, while the device may still be computing earlier layers."""
        if exported.ready is not None:
            exported.ready.synchronize()

    def layers_of(self, exported: ExportedPages) -> LayerRange | None:
        """The layer group `exported` holds; None for whole pages (every layer)."""
        r = exported.layers
        return None if r is None or r.is_all(self.layout.num_layers) else r

    def rows_per(self, exported: ExportedPages) -> int:
        """Rows of `exported` per batch: as many as fit the batch bound (a layer group's rows are shorter)."""
        layers = self.layers_of(exported)
        if layers is None:
            return self.rows_per_batch
        return max(1, self.max_batch_bytes // PageFormat(self.layout, layers.count).page_bytes)

    def rows_within(self, exported: ExportedPages, buffer_bytes: int) -> int:
        """The batch bound of `rows_per`, at most half a staging buffer of `buffer_bytes` (two batches in flight)."""
        row_bytes = exported.rows.shape[1] if exported.rows.dim() == 2 else self.fmt.page_bytes
        return max(1, min(KVSender.rows_per(self, exported), buffer_bytes // 2 // max(row_bytes, 1)))

    def _shipped(self, page_indexes: list[int], nbytes: int, span: int, layers: LayerRange | None = None) -> int:
        """Book a batch (of `layers` of its pages; None: all): page states, counters (a page counts once, with its
        last layer), its clock span. Returns its first seq_no."""
        first = self.pages.ship(page_indexes, nbytes, layers)
        with self._lock:
            self._spans.append((first + len(page_indexes) - 1, span))
        whole = layers is None or layers.stop == self.layout.num_layers
        self.stats.add(self.transport, pages=len(page_indexes) if whole else 0, bytes=nbytes, batches=1)
        return first

    def _header(
        self,
        first_seq_no: int,
        page_indexes: list[int],
        num_tokens: list[int],
        payload=None,
        layers: LayerRange | None = None,
    ) -> kv_pb2.KVBatchHeader:
        """The header of a batch of this request (`wire.make_header`; with `payload`, its checksum)."""
        return make_header(
            request_id=self.pages.request_id,
            fingerprint=self.fingerprint,
            layout=self.layout,
            first_seq_no=first_seq_no,
            page_indexes=page_indexes,
            num_tokens=num_tokens,
            payload=payload,
            layers=layers,
        )

    def ack(self, seq_no: int) -> bool:
        """Cumulative ack from the receiver; returns True when it freed the request's pages (all acked). A clock
        span (one `send` call: several batches) ends when its last batch is acked."""
        freed = self.pages.ack(seq_no)
        with self._acked_cv:
            done = {span for last, span in self._spans if last <= seq_no}
            self._spans = [(last, span) for last, span in self._spans if last > seq_no]
            finished = done - {span for _, span in self._spans}
            self._acked_cv.notify_all()
        for span in finished:
            self.clock.end(span)
        self._acked(seq_no)
        return freed

    def acks_ended(self) -> None:
        """The receiver closed its side of the stream: no ack will come (`drain` stops waiting)."""
        with self._acked_cv:
            self._acks_ended = True
            self._acked_cv.notify_all()

    def _acked(self, seq_no: int) -> None:
        """Transport hook: release what batches up to seq_no held (staging regions)."""
        return None

    def drain(self, timeout: float) -> None:
        """After PrefillDone, before the RPC ends: return once every shipped batch is acked (cuda-ipc: decode no
        longer reads the staging regions; both: the transfer clock covers every batch) or the receiver closed its
        side (`acks_ended`). Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._acked_cv:
            while self._spans and not self._acks_ended and not self._drain_stop():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._spans)} shipped batches unacknowledged after {timeout}s")
                self._acked_cv.wait(left)

    def _drain_stop(self) -> bool:
        """Transport hook: stop waiting for acks that cannot come (the transport failed)."""
        return False

    def failure(self) -> str:
        """Why this transfer's transport failed beside the stream ("": it did not): the request fails UNAVAILABLE."""
        return ""

    def close(self) -> None:
        """The RPC ended: free the pages if not all acked, release transport resources, book the time."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.pages.abandon()
        self._release_all()
        self.stats.add(self.transport, requests=1, transfer_seconds=self.clock.seconds())

    def _release_all(self) -> None:
        """Transport hook: give back everything still held."""
        return None


class KVReceiver(ABC):
    """Receiving side of one request: verifies each batch, fetches its bytes, acks, imports into the pool."""

    transport: str = ""

    def __init__(
        self,
        pages: ReceiverPages,
        expect: BatchExpectation,
        stats: TransferStats,
        device: torch.device,
        import_rows: ImportRows,
    ):
        self.pages = pages
        self.expect = expect
        self.fmt = PageFormat(expect.layout)
        self.stats = stats
        self.device = device
        self.import_rows = import_rows
        self.clock = BusyClock()
        self.pool: Executor | None = None  # fetches and checks batches off the stream's reader (receive_async)
        self._last: Future[int] | None = None  # the latest batch's completion (the next one waits for it)
        self._writes: list[Future] = []

    @abstractmethod
    def _fetch(self, header: kv_pb2.KVBatchHeader, source: Any) -> torch.Tensor:
        """Verify the transport part and return the batch as uint8 [N, row bytes] (a layer group's rows: that many
        layers) in memory this process owns on `self.device`, complete (no pending copy)."""

    def receive(self, header: kv_pb2.KVBatchHeader, source: Any) -> int:
        """One batch, on this thread: verified before any byte reaches the pool. Returns the seq_no to
        acknowledge. Raises CorruptPage or TransferError."""
        return self.receive_async(header, source).result()

    def receive_async(self, header: kv_pb2.KVBatchHeader, source: Any) -> Future[int]:
        """One batch: its header is verified and its pages claimed now (in arrival order); its bytes are fetched
        and checked on `self.pool` (on this thread without one), so the stream's reader can take the next
        message meanwhile. Batches reach the pool and are acknowledged in order: the Future holds the seq_no to
        acknowledge, or the CorruptPage / TransferError (this batch's or an earlier one's)."""
        verify_header(header, self.expect)
        indexes, tokens = list(header.page_indexes), list(header.num_tokens)
        layers = header_layers(header, self.expect.layout)
        whole = layers.is_all(self.expect.layout.num_layers)
        group = None if whole else layers  # None: whole pages (every layer of each)
        self.pages.check(header.first_seq_no, indexes, group)
        fmt = PageFormat(self.expect.layout, layers.count)
        span = self.clock.start()
        earlier, done = self._last, Future[int]()
        self._last = done

        def complete() -> None:
            try:
                rows = self._fetch(header, source)
                # NaN / inf pass a checksum: CorruptPage (DATA_LOSS). `_fetch` returned the rows complete, so the
                # check does not queue behind the decode step in flight on the engine's stream.
                check_values(*fmt.unpack(rows), complete=True)
                self.clock.end(span)
                if earlier is not None:
                    earlier.result()  # submitted (so started) before this one: in order, and its error is ours
                seq = self.pages.filled(indexes, header.nbytes, group)
                self._writes.append(self.import_rows(indexes, tokens, rows, group))
                pages = len(indexes) if layers.stop == self.expect.layout.num_layers else 0  # once, with its last
                self.stats.add(self.transport, pages=pages, bytes=header.nbytes, batches=1)
                done.set_result(seq)
            except BaseException as e:
                done.set_exception(e)

        self._schedule(header, complete)
        return done

    def _schedule(self, header: kv_pb2.KVBatchHeader, work: Callable[[], None]) -> None:
        """Run a batch's fetch-and-check `work`: on `self.pool`, or on this thread without one. Transports whose
        bytes arrive beside the stream run it once they did."""
        if self.pool is None:
            work()
        else:
            self.pool.submit(work)

    def finish(self, num_pages: int, timeout: float) -> None:
        """At PrefillDone: every page arrived and every pool write is done. Raises TransferError / the write's
        error."""
        if self._last is not None:
            self._last.result(timeout)
        for f in self._writes:
            f.result(timeout)
        self.pages.complete(num_pages)
        self.pages.acked()
        self.stats.add(self.transport, requests=1, transfer_seconds=self.clock.seconds())

    def fail(self) -> None:
        """Any failure before `finish` completed: free the reserved pages."""
        if self.pages.fail():
            self.stats.add(self.transport, requests=1, transfer_seconds=self.clock.seconds())


__all__ = ["ExportedPages", "ImportRows", "KVReceiver", "KVSender", "TransferError"]
