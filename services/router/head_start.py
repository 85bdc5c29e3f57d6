"""The router's head start: each request's prefill begins beside its dispatch to decode (`Prefill.Start`), instead
of when decode's Prefill stream reaches the prefill instance two hops later. Decode passes the start key on in its
PrefillRequest, and prefill's stream takes the started request over (`pdserve.prefill.head_start`). A start that
fails or is refused costs nothing but the call: decode's stream then computes the request as before."""

from __future__ import annotations

import logging
import os

import grpc

from pdserve.v1 import internal_pb2, internal_pb2_grpc

log = logging.getLogger("pdserve.router")

START_TIMEOUT_S = 5.0  # a Start only queues the request in the engine: far shorter than this when prefill is well


def head_start(
    stub: internal_pb2_grpc.PrefillStub, decode_req: internal_pb2.DecodeRequest, metadata: list[tuple[str, str]]
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
    future.add_done_callback(lambda f: _log_outcome(rid, f))
    return key


def wants_head_start(decode_req: internal_pb2.DecodeRequest) -> bool:
    """Whether prefill may start `decode_req` ahead: not a failover resume, nor n / best_of > 1 (forks sample
    their own first tokens at decode; prefill starts those from decode's stream)."""
    return not (decode_req.resumed_tokens or decode_req.n or decode_req.best_of)


def _log_outcome(rid: str, future: grpc.Future) -> None:
    try:
        started = future.result()
    except grpc.RpcError as e:
        log.debug("rid=%s head start failed: %s %s", rid, e.code(), e.details())
        return
    except grpc.FutureCancelledError:
        return
    if not started.started:
        log.debug("rid=%s head start not taken: %s", rid, started.reason)
