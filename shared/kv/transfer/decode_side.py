"""Decode's end of the KV handoff: one `DecodeConnector` per process (`for_decode`), one `IncomingTransfer` per
request. The servicer opens the Prefill stream and hands each message to the transfer; the transport choice and its
fallback, batch checks and copies (pipelined on `--kv-copy-threads`), acks and the page timeout are here.

    rx = connector.open(request_id, num_pages, free, import_rows, peer)
    call = stub(rx.messages(prefill_request), ...)   # the request (this end's offer and layout filled in), then acks
    rx.attach(call.cancel)                 # the page watchdog and a failed batch end the stream through it
    for raw in call:
        msg = rx.receive(raw)              # None: taken here (choice, batch); else PrefillFirstToken / PrefillDone
    rx.finish(done)                        # every page arrived, checked and in the pool
    rx.failure()                           # after the stream broke: this end's reason, if it broke it
    rx.close()                             # always: an unfinished transfer frees its pages and ends the stream
"""

from __future__ import annotations

import os
import queue
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from pdserve.errors import (
    CorruptPage,
    DeadlineExceeded,
    InvalidRequest,
    PdserveError,
    PeerUnavailable,
    TransferError,
    TransportUnusable,
)
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.shipper.link import Inbox
from pdserve.kv.transfer.base import ImportRows, KVReceiver
from pdserve.kv.transfer.cuda_ipc import IpcBufferCache, IpcReceiver, copier_for
from pdserve.kv.transfer.grpc_shm import ShmReceiver, start_shipper
from pdserve.kv.transfer.grpc_transport import GrpcReceiver
from pdserve.kv.transfer.handshake import (
    CUDA_IPC,
    GRPC,
    GRPC_SHM,
    TRANSFER_KEY_BYTES,
    ShardLayout,
    fall_back,
    make_offer,
)
from pdserve.kv.transfer.pages import ReceiverPages
from pdserve.kv.transfer.stats import TransferStats
from pdserve.kv.transfer.timeouts import PageBudget, PeerLoads, Watchdog
from pdserve.kv.transfer.wire import BatchExpectation, parse_server_message
from pdserve.server.announce import advertised
from pdserve.v1 import internal_pb2, kv_pb2


def advertised_host(host: str) -> str:
    """The host peers dial for this process's ports: the bound one, or the machine's name for a wildcard bind."""
    return advertised(host, 0).rsplit(":", 1)[0]


_BAD_PEER = (TransferError, CorruptPage, InvalidRequest)  # damaged, out of order or not ours: the peer's fault


class ReceiverConfig(Protocol):
    """The decode settings the connector reads (`DecodeConfig`)."""

    kv_transport: str  # auto | grpc | cuda-ipc | grpc-shm (offered in each request)
    kv_copy_threads: int  # threads checking and copying batches off the stream's reader (0: none)
    page_timeout_s: float  # shortest bound on the wait for the next message from prefill (`timeouts.PageBudget`)
    page_timeout_max_s: float  # its longest, however much work is ahead
    page_timeout_slack: float  # its margin over the expected time of the work ahead
    first_token_early: bool  # ask prefill for the first token ahead of the pages


class DecodeConnector:
    """Process-wide: what this instance offers, the pool layout it asks for, the opened peer staging buffers, the
    copy threads and the transfer counters."""

    def __init__(
        self,
        cfg: ReceiverConfig,
        device: torch.device,
        layout: KVLayoutSpec,
        fingerprint: str,
        shards: ShardLayout | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.layout = layout
        self.fingerprint = fingerprint
        self.stats = TransferStats()  # per transport: requests, pages, bytes, seconds, fallbacks
        budget = PageBudget(cfg.page_timeout_s, cfg.page_timeout_max_s, cfg.page_timeout_slack)
        self.loads = PeerLoads(budget)  # per prefill instance: tokens awaited, arrival rate (the page timeout)
        self.shards = shards or ShardLayout(1, layout.num_kv_heads)  # this instance's split of the KV heads
        self.offer = make_offer(cfg.kv_transport, device, self.shards)
        self.buffers = IpcBufferCache(copier_for(device))  # prefill staging buffers, opened once each
        # grpc batches' host -> device copies: one side stream, so its cached blocks stay few (`device_copy`)
        self.copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.copy_pool = (
            ThreadPoolExecutor(cfg.kv_copy_threads, thread_name_prefix="kv-copy") if cfg.kv_copy_threads else None
        )
        self.shipper = start_shipper(cfg, "decode", device)  # grpc-shm (None: not run here)
        self.shipper_host = advertised_host(getattr(cfg, "host", "127.0.0.1"))

    def open(
        self,
        request_id: str,
        num_pages: int,
        free: Callable[[], object],
        import_rows: ImportRows,
        peer: str,
    ) -> IncomingTransfer:
        """The transfer of one request's `num_pages` pages from prefill `peer`; `free` gives the reserved pages back
        (once, on failure), `import_rows` writes a checked batch into the pool."""
        pages = ReceiverPages(request_id, num_pages, free=free, num_layers=self.layout.num_layers)
        return IncomingTransfer(self, pages, import_rows, peer)

    def offer_for(self, request_id: str) -> tuple[kv_pb2.KVTransportOffer, Inbox | None]:
        """This request's offer, with grpc-shm (the shippers' addresses and a fresh transfer key, whose inbox is
        returned) when every shipper serves and --kv-transport allows it. TransportUnusable when grpc-shm is forced
        and a shipper is down."""
        mode = self.cfg.kv_transport
        if mode not in ("auto", GRPC_SHM):
            return self.offer, None
        if self.shipper is None or not self.shipper.ready():
            if mode == GRPC_SHM:
                raise TransportUnusable("kv transport grpc-shm forced but decode's KV shipper is not running")
            return self.offer, None
        offer = kv_pb2.KVTransportOffer()
        offer.CopyFrom(self.offer)
        if GRPC_SHM not in offer.transports:
            offer.transports.append(GRPC_SHM)
        key = os.urandom(TRANSFER_KEY_BYTES)
        first, *more = self.shipper.addresses(self.shipper_host)
        offer.shipper_address = first  # a prefill that knows only this field pushes every batch there
        offer.more_shipper_addresses.extend(more)
        offer.transfer_key = key
        return offer, self.shipper.inbox(key)

    def receiver(
        self, transport: str, pages: ReceiverPages, import_rows: ImportRows, buffer_id: str, inbox: Inbox | None
    ) -> KVReceiver:
        args = (pages, BatchExpectation(self.layout, self.fingerprint, pages.request_id), self.stats, self.device)
        rx: KVReceiver
        if transport == CUDA_IPC:
            rx = IpcReceiver(*args, import_rows, buffers=self.buffers, buffer_id=buffer_id)
        elif transport == GRPC_SHM:
            assert inbox is not None
            shm = ShmReceiver(*args, import_rows, inbox=inbox)
            shm.copy_stream = self.copy_stream
            rx = shm
        else:
            rx = GrpcReceiver(*args, import_rows)
            rx.copy_stream = self.copy_stream
        rx.pool = self.copy_pool  # batches checked and copied while the stream's reader takes the next
        return rx

    def close(self) -> None:
        if self.copy_pool is not None:
            self.copy_pool.shutdown(wait=False, cancel_futures=True)
        if self.shipper is not None:
            self.shipper.close()


class IncomingTransfer:
    """One request's pages arriving from prefill. `receive`, `finish` and `close` run on the Generate call's thread;
    batches complete on the copy threads (acked from there, in order)."""

    def __init__(self, connector: DecodeConnector, pages: ReceiverPages, import_rows: ImportRows, peer: str) -> None:
        self._connector = connector
        self.pages = pages
        self.peer = peer
        self.receiver: KVReceiver | None = None  # once prefill chose the transport
        self._import_rows = import_rows
        self._outbox: queue.Queue[internal_pb2.PrefillClientMessage | None] = queue.Queue()  # None: no more
        self._pending: deque[Future] = deque()  # batches being checked and copied, in stream order
        self._cancel: Callable[[], object] = lambda: None
        self._watchdog: Watchdog | None = None
        self._first_token = False
        self.peer_shards: ShardLayout | None = None  # prefill's split of the KV heads, from its choice
        self._inbox: Inbox | None = None  # grpc-shm: where this request's bytes land, when offered
        self.work = connector.loads.open(peer, len(pages.states) * connector.layout.page_size)  # the page timeout

    @property
    def transport(self) -> str:
        return self.receiver.transport if self.receiver is not None else ""

    def messages(self, request: internal_pb2.PrefillRequest) -> Iterator[internal_pb2.PrefillClientMessage]:
        """The Prefill stream's messages: `request` with this end's layout, fingerprint, first-token wish and
        transport offer filled in, then acks and the readiness answer as they come, until `close`."""
        c = self._connector
        request.kv_layout.CopyFrom(c.layout.to_proto())
        request.model_fingerprint = c.fingerprint
        request.first_token_early = c.cfg.first_token_early
        request.kv_layer_groups = True  # batches of a layer range are taken (`layers`): prefill may stream them
        offer, self._inbox = c.offer_for(self.pages.request_id)
        request.kv_transport.CopyFrom(offer)
        first = internal_pb2.PrefillClientMessage(request=request)

        def stream() -> Iterator[internal_pb2.PrefillClientMessage]:
            yield first
            while (item := self._outbox.get()) is not None:
                yield item

        return stream()

    def attach(self, cancel: Callable[[], object]) -> None:
        """The stream is open: `cancel` ends it (prefill silent past page_timeout_s, a batch failed its checks)."""
        self._cancel = cancel
        name = f"pages-{self.pages.request_id[:8]}"
        self._watchdog = Watchdog(self.work.timeout_s, cancel, name=name)  # scaled with the work ahead

    def receive(self, raw: bytes) -> internal_pb2.PrefillServerMessage | None:
        """One message from prefill. The transport choice and KV batches are taken here (None); PrefillFirstToken
        and PrefillDone are returned. TransferError for a bad one; TransportUnusable when a forced cuda-ipc cannot
        open prefill's buffer."""
        if self._watchdog is not None:
            self._watchdog.feed()
        claimed = self.pages.pages_claimed  # pages whose last layer arrived (a layer group is part of a page)
        try:
            return self._take(raw)
        except _BAD_PEER as e:
            raise TransferError(f"bad KV batch from prefill: {e}") from e
        finally:
            self.work.arrived((self.pages.pages_claimed - claimed) * self._connector.layout.page_size)

    def _take(self, raw: bytes) -> internal_pb2.PrefillServerMessage | None:
        msg, header, payload = parse_server_message(raw)
        kind = msg.WhichOneof("msg") if msg is not None else "batch"
        if kind == "transport":
            assert msg is not None
            self._choose(msg.transport)
        elif kind == "first_token":
            if not self._connector.cfg.first_token_early or self._first_token:
                raise TransferError("first token sent early unasked, or twice")
            self._first_token = True
            return msg
        elif kind == "done":
            return msg
        elif self.receiver is None:
            raise TransferError("KV batch before the transport choice")
        elif header is not None:
            self._batch(self.receiver.receive_async(header, payload))
        elif msg is not None and kind == "ipc_batch":
            self._batch(self.receiver.receive_async(msg.ipc_batch.header, msg.ipc_batch))
        elif msg is not None and kind == "shipped_batch":
            self._batch(self.receiver.receive_async(msg.shipped_batch.header, msg.shipped_batch))
        else:
            raise TransferError(f"unexpected message from prefill: {kind}")
        return None

    def _choose(self, choice: kv_pb2.KVTransportChoice) -> None:
        """Prefill's transport choice. cuda-ipc: open its buffer (once per buffer) and answer KVTransportReady; if
        it cannot be opened, grpc for this request (`handshake.fall_back`)."""
        if self.receiver is not None:
            raise TransferError("second transport choice on one stream")
        self.peer_shards = ShardLayout.from_proto(choice.shards, self._connector.layout.num_kv_heads)
        why = self.peer_shards.problem(self._connector.layout.num_kv_heads)
        if why:  # pages hold every head whatever prefill's split; a split that cannot hold them is a broken peer
            raise TransferError(f"prefill's tensor-parallel layout: {why}")
        transport = choice.transport
        if transport not in (GRPC, CUDA_IPC, GRPC_SHM):
            raise TransferError(f"prefill chose unknown kv transport {transport!r}")
        if transport == GRPC_SHM and self._inbox is None:
            raise TransferError("prefill chose grpc-shm, which this request did not offer")
        if transport != GRPC_SHM and self._inbox is not None:
            self._inbox.close()  # offered, not chosen
            self._inbox = None
        if transport == CUDA_IPC:
            try:
                self._connector.buffers.get(choice.ipc_buffer)
                ready = kv_pb2.KVTransportReady(ok=True)
            except Exception as e:
                reason = f"cannot open prefill's {choice.ipc_buffer.kind} buffer: {e}"
                forced = self._connector.cfg.kv_transport == CUDA_IPC
                transport = fall_back(self._connector.stats, self.pages.request_id, reason, forced)
                ready = kv_pb2.KVTransportReady(ok=False, reason=reason)
            self._outbox.put(internal_pb2.PrefillClientMessage(transport_ready=ready))
        self.receiver = self._connector.receiver(
            transport, self.pages, self._import_rows, choice.ipc_buffer.buffer_id, self._inbox
        )

    def _batch(self, done: Future[int]) -> None:
        self._pending.append(done)
        done.add_done_callback(self._batch_done)
        while self._pending and self._pending[0].done():  # drop the finished leading ones; raise the first error
            self._pending.popleft().result()

    def _batch_done(self, done: Future[int]) -> None:
        """A batch is in the pool's queue: acknowledge it now (cumulative acks: their order does not matter), so
        prefill may reuse what it held even while no message arrives here. A failed batch ends the stream, which
        wakes the reader to report it (`failure`)."""
        if done.exception() is None:
            self._outbox.put(internal_pb2.PrefillClientMessage(ack=internal_pb2.KVAck(seq_no=done.result())))
            self.pages.acked()
        else:
            self._cancel()

    def finish(self, done: internal_pb2.PrefillDone) -> None:
        """At PrefillDone: every batch before it checked and in the pool, every announced page arrived. Then the
        engine's sequence owns the pages. TransferError / DeadlineExceeded (page_timeout_s) otherwise."""
        if self.receiver is None:
            raise TransferError("PrefillDone before the transport choice")
        timeout = self._connector.cfg.page_timeout_s
        try:
            while self._pending:
                self._pending.popleft().result(timeout)
            self.receiver.finish(done.num_pages, timeout)
        except _BAD_PEER as e:
            raise TransferError(f"bad KV batch from prefill: {e}") from e
        except TimeoutError:
            raise DeadlineExceeded(f"KV batches not stored within {timeout}s") from None

    def failure(self) -> PdserveError | None:
        """After the stream broke: why, when this end broke it (a batch that failed its checks: TransferError;
        prefill silent past page_timeout_s: DeadlineExceeded); None when the peer or the caller did."""
        bad = next((f.exception() for f in self._pending if f.done() and f.exception() is not None), None)
        if isinstance(bad, PeerUnavailable):  # grpc-shm: the bytes' way (a shipper) broke, not the peer's data
            return bad
        if bad is not None:
            return TransferError(f"bad KV batch from prefill: {bad}")
        if self._watchdog is not None and self._watchdog.expired:
            return DeadlineExceeded(
                f"no KV page from prefill {self.peer} within {self._watchdog.expired_after:.3g}s "
                f"({self.work.describe()}; {self.pages.next_seq_no} pages received)"
            )
        return None

    def close(self) -> None:
        """However the transfer ended: stop the watchdog, end the stream's outgoing side; unless it completed, end
        the stream and free the reserved pages."""
        if self._watchdog is not None:
            self._watchdog.stop()
        self.work.close()
        self._outbox.put(None)
        if self._inbox is not None:
            self._inbox.close()  # whatever landed and was not taken goes back to the shipper
        if self.pages.completed:
            return
        self._cancel()
        if self.receiver is not None:
            self.receiver.fail()
        else:
            self.pages.fail()


def for_decode(
    cfg: ReceiverConfig,
    device: torch.device,
    layout: KVLayoutSpec,
    fingerprint: str,
    shards: ShardLayout | None = None,
) -> DecodeConnector:
    """The decode end of the handoff for one process (engine on `device`, its pool in `layout`, its KV heads split
    over its tensor-parallel ranks as `shards`; None: one rank)."""
    return DecodeConnector(cfg, device, layout, fingerprint, shards)
