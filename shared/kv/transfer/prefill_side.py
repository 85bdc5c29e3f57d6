"""Prefill's end of the KV handoff: one `PrefillConnector` per process (`for_prefill`), one `OutgoingTransfer` per
request. The servicer only calls these; transports, the handshake, the fallback, staging and the ack bound are here.

    tx = connector.open(request_id, num_pages, layout, offer, layer_groups)  # transport agreed; tx.layer_group
    yield tx.choice                  # the stream's first message
    tx.listen(request_iterator)      # decode's acks and readiness, on a thread of its own
    yield from tx.send(exported)     # per chunk: its batches' messages (the first call waits for decode's readiness)
    tx.poll()                        # between messages: DeadlineExceeded once a page waits past ack_timeout_s
    tx.finish(timeout)               # after PrefillDone: decode acknowledged what the sender still holds
    tx.abort()                       # the RPC ended, any way: pages not all acknowledged are freed (idempotent)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc
import torch

from pdserve.errors import DeadlineExceeded, PeerUnavailable, TransferError, TransportUnusable
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.base import ExportedPages, KVSender
from pdserve.kv.transfer.cuda_ipc import IpcSender, IpcStaging, copier_for
from pdserve.kv.transfer.grpc_shm import ShmSender, start_shipper
from pdserve.kv.transfer.grpc_transport import GrpcSender
from pdserve.kv.transfer.handshake import CUDA_IPC, ShardLayout, choose, fall_back, host_id
from pdserve.kv.transfer.layers import effective_group
from pdserve.kv.transfer.modes import GRPC_SHM
from pdserve.kv.transfer.pages import SenderPages
from pdserve.kv.transfer.stats import TransferStats
from pdserve.kv.transfer.timeouts import AckClock
from pdserve.v1 import internal_pb2, kv_pb2

log = logging.getLogger("pdserve.kv.transfer")


class SenderConfig(Protocol):
    """The prefill settings the connector reads (`PrefillConfig`)."""

    kv_transport: str  # auto | grpc | cuda-ipc | grpc-shm
    kv_batch_mb: float  # grpc: page bytes per message
    kv_ipc_staging_mb: float  # cuda-ipc: the staging buffer
    kv_copy_threads: int  # grpc: threads building messages ahead of the writer (0: none)
    ack_timeout_s: float  # longest a shipped page may stay unacknowledged
    kv_layer_group: int  # layers per shipment of a computed chunk (0: whole chunks), for a decode that accepts them


class PrefillConnector:
    """Process-wide: the transfer counters, the cuda-ipc staging buffer (registered on first use) and the grpc
    message builders. `release(request_id)` gives a request's pages back to the engine."""

    def __init__(
        self,
        cfg: SenderConfig,
        device: torch.device,
        fingerprint: str,
        release: Callable[[str], object],
        shards: ShardLayout | None = None,
    ) -> None:
        self.cfg = cfg
        self.shards = shards  # this instance's split of the KV heads over its ranks (None: one rank)
        self.device = device
        self.fingerprint = fingerprint
        self.release = release
        self.stats = TransferStats()  # per transport: requests, pages, bytes, seconds, fallbacks
        self.host_id = host_id()
        self._lock = threading.Lock()
        self._staging: IpcStaging | None = None
        self._staging_error = ""
        self._build_pool = (
            ThreadPoolExecutor(cfg.kv_copy_threads, thread_name_prefix="kv-build") if cfg.kv_copy_threads else None
        )
        self.shipper = start_shipper(cfg, "prefill", device)  # grpc-shm (None: not run here)

    def open(
        self,
        request_id: str,
        num_pages: int,
        layout: KVLayoutSpec,
        offer: kv_pb2.KVTransportOffer | None,
        layer_groups: bool = False,
    ) -> OutgoingTransfer:
        """The transfer of one request's `num_pages` pages in `layout`, on the transport agreed with decode's
        `offer` and --kv-transport; in layer groups of --kv-layer-group layers when decode accepts them
        (`layer_groups`, `PrefillRequest.kv_layer_groups`). Raises TransportUnusable when a forced transport cannot
        work."""
        mode = self.cfg.kv_transport
        may_ipc = mode == CUDA_IPC or (
            mode == "auto" and offer is not None and CUDA_IPC in offer.transports and offer.host_id == self.host_id
        )
        may_shm = mode == GRPC_SHM or (offer is not None and GRPC_SHM in offer.transports)
        ipc_problem = self._staging_unavailable() if may_ipc else ""
        shm_problem = self._shipper_unavailable() if may_shm else "decode offers no grpc-shm"
        choice = choose(offer, mode, self.host_id, self.device.type, ipc_problem, shm_problem)
        if choice.error:
            raise TransportUnusable(choice.error)
        if choice.fallback:
            fall_back(self.stats, request_id, choice.reason, forced=False)
        forced = mode == CUDA_IPC or (offer is not None and offer.forced and list(offer.transports) == [CUDA_IPC])
        message = kv_pb2.KVTransportChoice(transport=choice.transport, reason=choice.reason)
        if choice.transport == CUDA_IPC:
            assert self._staging is not None  # choose() picks cuda-ipc only with the buffer registered
            message.ipc_buffer.CopyFrom(self._staging.desc)
        message.shards.CopyFrom((self.shards or ShardLayout(1, layout.num_kv_heads)).to_proto())
        pages = SenderPages(request_id, num_pages, free=lambda: self.release(request_id), num_layers=layout.num_layers)
        tx = OutgoingTransfer(self, message, pages, layout, forced, offer)
        tx.layer_group = effective_group(self.cfg.kv_layer_group, layout.num_layers, layer_groups)
        return tx

    def sender(
        self, transport: str, pages: SenderPages, layout: KVLayoutSpec, offer: kv_pb2.KVTransportOffer | None = None
    ) -> KVSender:
        args = (pages, layout, self.fingerprint, self.stats)
        if transport == GRPC_SHM:
            assert self.shipper is not None and offer is not None  # choose() picks grpc-shm only then
            return ShmSender(
                *args,
                max_batch_bytes=int(self.cfg.kv_batch_mb * 2**20),
                link=self.shipper,
                addresses=[offer.shipper_address, *offer.more_shipper_addresses],  # a decode of one: all to it
                key=offer.transfer_key,
                reserve_timeout=self.cfg.ack_timeout_s,
            )
        if transport == CUDA_IPC:
            assert self._staging is not None
            return IpcSender(
                *args,
                max_batch_bytes=self._staging.nbytes,
                staging=self._staging,
                reserve_timeout=self.cfg.ack_timeout_s,
            )
        return GrpcSender(
            *args,
            max_batch_bytes=int(self.cfg.kv_batch_mb * 2**20),
            pool=self._build_pool,
            lookahead=self.cfg.kv_copy_threads,
        )

    def _staging_unavailable(self) -> str:
        """Register the cuda-ipc staging buffer once; "" when it serves, else why not."""
        with self._lock:
            if self._staging is None and not self._staging_error:
                try:
                    nbytes = int(self.cfg.kv_ipc_staging_mb * 2**20)
                    self._staging = IpcStaging(copier_for(self.device), nbytes)
                    log.info("cuda-ipc staging buffer: %d MiB on %s", nbytes >> 20, self.device)
                except Exception as e:
                    self._staging_error = f"staging buffer registration failed: {e}"
                    log.warning("cuda-ipc unusable: %s", self._staging_error)
            return self._staging_error

    def _shipper_unavailable(self) -> str:
        """ "" when every shipper serves (those that exited started again), else why not."""
        if self.shipper is None:
            return "prefill runs no KV shipper (--kv-shipper)"
        return "" if self.shipper.ready() else "one of prefill's KV shippers is not running"

    def close(self) -> None:
        """Service shutdown: release the staging buffer (its shared-memory file on CPU), the builders, the
        shipper."""
        if self._staging is not None:
            self._staging.close()
        if self.shipper is not None:
            self.shipper.close()
        if self._build_pool is not None:
            self._build_pool.shutdown(wait=False, cancel_futures=True)


class OutgoingTransfer:
    """One request's pages on their way to decode. The stream writer calls `send` / `poll` / `finish`; the ack reader
    (`listen`) acks; `abort` may come from any thread (the RPC's end)."""

    def __init__(
        self,
        connector: PrefillConnector,
        choice: kv_pb2.KVTransportChoice,
        pages: SenderPages,
        layout: KVLayoutSpec,
        forced: bool,
        offer: kv_pb2.KVTransportOffer | None = None,
    ) -> None:
        self._connector = connector
        self.pages = pages
        self.layout = layout
        self.choice = internal_pb2.PrefillServerMessage(transport=choice)
        self.sender = connector.sender(choice.transport, pages, layout, offer)  # grpc on decode's cuda-ipc refusal
        self.clock = AckClock()
        self.layer_group = 0  # layers per shipment of a computed chunk (0: whole chunks; `layers.effective_group`)
        self._forced = forced  # cuda-ipc forced by either end: no fallback
        self._confirmed = choice.transport != CUDA_IPC  # cuda-ipc: decode must open the buffer first
        self._answered = threading.Event()
        self._answer: kv_pb2.KVTransportReady | None = None

    @property
    def transport(self) -> str:
        return self.sender.transport

    @property
    def device_to_device(self) -> bool:
        """Bytes move device to device: a cached prefix ships from the engine's device copy of it."""
        return self.sender.device_to_device

    def listen(self, request_iterator: Iterator[internal_pb2.PrefillClientMessage]) -> None:
        """Read decode's messages after the request (acks; the readiness answer) on a thread until they end."""
        name = f"acks-{self.pages.request_id[:8]}"
        threading.Thread(target=self._read, args=(request_iterator,), daemon=True, name=name).start()

    def _read(self, request_iterator: Iterator[internal_pb2.PrefillClientMessage]) -> None:
        try:
            for msg in request_iterator:
                if msg.HasField("ack"):
                    self.clock.acked(msg.ack.seq_no)
                    self.sender.ack(msg.ack.seq_no)  # the last one frees the pages
                elif msg.HasField("transport_ready"):
                    self._answer_once(msg.transport_ready)
        except (grpc.RpcError, TransferError) as e:
            log.debug("ack stream ended: %s", e)
        except Exception:
            log.exception("ack reader failed")
        finally:
            self._answer_once(None)  # a writer still waiting for readiness stops waiting
            self.sender.acks_ended()  # ... and one draining stops waiting for acks

    def _answer_once(self, answer: kv_pb2.KVTransportReady | None) -> None:
        if not self._answered.is_set():
            self._answer = answer
            self._answered.set()

    def connect(self) -> None:
        """Before the first batch on cuda-ipc: decode opened the buffer, or this request falls back to grpc
        (`handshake.fall_back`: TransportUnusable when forced); PeerUnavailable when decode never answered."""
        if self._confirmed:
            return
        self._confirmed = True
        self._answered.wait(self._connector.cfg.ack_timeout_s)
        answer = self._answer
        if answer is not None and answer.ok:
            return
        if answer is None:
            raise PeerUnavailable("decode did not confirm the cuda-ipc buffer")
        transport = fall_back(self._connector.stats, self.pages.request_id, f"decode: {answer.reason}", self._forced)
        self.sender = self._connector.sender(transport, self.pages, self.layout)

    def send(self, exported: ExportedPages) -> Iterable[Any]:
        """Ship a chunk's pages; the stream messages to yield, in order. DeadlineExceeded when the transport stalls
        (cuda-ipc: no staging region freed within ack_timeout_s); TransferError on a protocol break."""
        self.connect()
        try:
            msgs = self.sender.send(exported)
        except TimeoutError as e:
            raise DeadlineExceeded(f"KV transfer stalled: {e}") from e
        except TransferError as e:
            raise TransferError(f"KV transfer failed ({self.transport}): {e}") from e
        except PeerUnavailable:
            raise
        except Exception as e:  # prefill's own fault: INTERNAL
            raise RuntimeError(f"KV transfer failed ({self.transport}): {e}") from e
        self.clock.shipped(len(exported.page_indexes))
        return msgs

    def poll(self) -> None:
        """DeadlineExceeded once decode left a shipped page unacknowledged past ack_timeout_s (it stopped storing
        pages: they are given back when the RPC ends)."""
        failed = self.sender.failure()
        if failed:
            raise PeerUnavailable(f"KV transfer failed ({self.transport}): {failed}")
        timeout, clock = self._connector.cfg.ack_timeout_s, self.clock
        if clock.oldest_unacked_age() > timeout:
            raise DeadlineExceeded(
                f"decode acknowledged {clock.num_acked} of {clock.num_shipped} KV pages; page "
                f"{clock.num_acked} unacknowledged after ack_timeout_s={timeout}s"
            )

    def finish(self, timeout: float) -> None:
        """After PrefillDone: wait until decode acknowledged what the sender holds for it (cuda-ipc: staging
        regions; grpc: nothing) or closed its side. DeadlineExceeded after `timeout`."""
        try:
            self.sender.drain(timeout)
        except TimeoutError as e:
            raise DeadlineExceeded(f"decode did not acknowledge KV: {e}") from e

    def abort(self) -> None:
        """The RPC ended (cancel, deadline, error, success): pages not all acknowledged are freed, staging given
        back, the request counted. Idempotent."""
        self.sender.close()


def for_prefill(
    cfg: SenderConfig,
    device: torch.device,
    fingerprint: str,
    release: Callable[[str], object],
    shards: ShardLayout | None = None,
) -> PrefillConnector:
    """The prefill end of the handoff for one process (engine on `device`, model `fingerprint`, its KV heads split
    over its tensor-parallel ranks as `shards`; None: one rank)."""
    return PrefillConnector(cfg, device, fingerprint, release, shards)
