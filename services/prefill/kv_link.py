"""One request's link to decode on the prefill side: the transport chosen in the handshake, the sender in use
(switched to grpc if decode cannot open the cuda-ipc buffer) and decode's readiness answer."""

from __future__ import annotations

import threading

from pdserve.kv.transfer.base import KVSender
from pdserve.kv.transfer.cuda_ipc import IpcStaging
from pdserve.kv.transfer.handshake import Choice
from pdserve.kv.transfer.pages import SenderPages
from pdserve.v1 import kv_pb2


class SendLink:
    """Shared by the stream writer (sends, may switch the sender before the first batch) and the ack reader."""

    def __init__(self, choice: Choice, pages: SenderPages, forced: bool, staging: IpcStaging | None):
        self.pages = pages
        self.forced = forced  # cuda-ipc forced by either end: no fallback
        self.choice = kv_pb2.KVTransportChoice(transport=choice.transport, reason=choice.reason)
        if staging is not None:
            self.choice.ipc_buffer.CopyFrom(staging.desc)
        self.sender: KVSender  # set by the servicer right after construction
        self._ready = threading.Event()
        self._answer: kv_pb2.KVTransportReady | None = None

    def set_ready(self, answer: kv_pb2.KVTransportReady | None) -> None:
        """Decode's KVTransportReady (None: the stream ended without one). The first call wins."""
        if not self._ready.is_set():
            self._answer = answer
            self._ready.set()

    def wait_ready(self, timeout: float) -> kv_pb2.KVTransportReady | None:
        self._ready.wait(timeout)
        return self._answer
