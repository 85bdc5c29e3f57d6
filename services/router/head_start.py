"""The router's head start: each request's prefill begins beside its dispatch to decode (`Prefill.Start`), instead
of when decode's Prefill stream reaches the prefill instance two hops later. Decode passes the start key on in its
PrefillRequest, and prefill's stream takes the started request over (`pdserve.prefill.head_start`). A start that
fails or is refused costs nothing but the call: decode's stream then computes the request as before. A prefill
that does not serve Start (an older version) is not asked again for a while."""

from __future__ import annotations

import logging
import os
import threading
import time

import grpc

from pdserve.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("pdserve.router")

START_TIMEOUT_S = 5.0  # a Start only queues the request in the engine: far shorter than this when prefill is well
UNSERVED_RETRY_S = 60.0  # how long a prefill that answered UNIMPLEMENTED is not asked (a rolling upgrade ends)


class HeadStarts:
    """`start` fires `Prefill.Start` for a request; remembers which prefill instances do not serve it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unserved: dict[str, float] = {}  # prefill address -> when to ask again

    def wants(self, address: str, decode_req: internal_pb2.DecodeRequest) -> bool:
        """Whether to start `decode_req` ahead on `address`: not a failover resume, nor n / best_of > 1 (forks sample
        their own first tokens at decode: prefill starts those from decode's stream), nor a prefill that does not
        serve Start."""
        if decode_req.resumed_tokens or decode_req.n or decode_req.best_of:
            return False
        with self._lock:
            again = self._unserved.get(address)
            if again is not None and time.monotonic() < again:
                return False
            self._unserved.pop(address, None)
        return True

    def start(
        self,
        address: str,
        stub: internal_pb2_grpc.PrefillStub,
        decode_req: internal_pb2.DecodeRequest,
        metadata: list[tuple[str, str]],
    ) -> bytes:
        """Fire `Prefill.Start` for `decode_req` (not waited for) and return the start key decode must pass on."""
        key = os.urandom(16)
        start = internal_pb2.PrefillStart(
            request_id=decode_req.request_id,
            prompt_token_ids=decode_req.prompt_token_ids,
            sampling=decode_req.sampling,
            cache_scope=decode_req.cache_scope,
            start_key=key,
        )
        rid = decode_req.request_id
        future = stub.Start.future(start, timeout=START_TIMEOUT_S, metadata=metadata)
        future.add_done_callback(lambda f: self._outcome(address, rid, f))
        return key

    def _outcome(self, address: str, rid: str, future: grpc.Future) -> None:
        try:
            started = future.result()
        except grpc.FutureCancelledError:
            return
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                with self._lock:
                    first = address not in self._unserved
                    self._unserved[address] = time.monotonic() + UNSERVED_RETRY_S
                if first:
                    log.info("prefill %s does not serve head starts (Prefill.Start): not asked for %.0f s",
                             address, UNSERVED_RETRY_S)  # fmt: skip
            else:
                log.debug("rid=%s head start failed: %s %s", rid, e.code(), e.details())
            return
        if not started.started:
            log.debug("rid=%s head start not taken: %s", rid, started.reason)
