"""The router's side of the head start (`pdserve.router.head_start`) against real gRPC servers: what a Start carries,
which requests get one, and a prefill that does not serve Start (an older version) left alone for a while."""

from __future__ import annotations

import queue

from pdserve.router import head_start
from pdserve.router.head_start import HeadStarts
from pdserve.server.grpc_util import channel
from pdserve.testing.impostors import serve
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc


class StartOnly(internal_pb2_grpc.PrefillServicer):
    def __init__(self) -> None:
        self.got: queue.Queue = queue.Queue()

    def Start(self, request, context):
        self.got.put((request, dict(context.invocation_metadata())))
        return internal_pb2.PrefillStarted(started=True)


def decode_request(**fields) -> internal_pb2.DecodeRequest:
    return internal_pb2.DecodeRequest(
        request_id="r1", prompt_token_ids=[5, 6, 7], sampling=generate_pb2.SamplingParams(temperature=0.5),
        cache_scope="tenant-a", prefill_target="p", **fields,
    )  # fmt: skip


def test_start_carries_the_request_and_a_fresh_key_decode_passes_on():
    servicer = StartOnly()
    addr, server = serve(lambda s: internal_pb2_grpc.add_PrefillServicer_to_server(servicer, s))
    try:
        starts, req = HeadStarts(), decode_request()
        with channel(addr) as ch:
            assert starts.wants(addr, req)
            parent = [("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")]
            key = starts.start(addr, internal_pb2_grpc.PrefillStub(ch), req, parent)
            got, metadata = servicer.got.get(timeout=10)
            again = starts.start(addr, internal_pb2_grpc.PrefillStub(ch), req, [])
            servicer.got.get(timeout=10)
        assert len(key) == 16 and again != key
        assert (got.request_id, list(got.prompt_token_ids), got.cache_scope) == ("r1", [5, 6, 7], "tenant-a")
        assert got.sampling == req.sampling and got.start_key == key
        assert metadata["traceparent"].startswith("00-" + "1" * 32)  # prefill.start continues the router's trace
        assert starts.wants(addr, req)
    finally:
        server.stop(None)


def test_no_head_start_for_resumes_or_forks():
    starts = HeadStarts()
    assert not starts.wants("p", decode_request(resumed_tokens=3))
    assert not starts.wants("p", decode_request(n=2))
    assert not starts.wants("p", decode_request(best_of=3))


def test_a_prefill_without_start_is_left_alone_then_asked_again(monkeypatch):
    addr, server = serve(lambda s: None)  # serves nothing of Prefill: UNIMPLEMENTED
    try:
        starts, req = HeadStarts(), decode_request()
        monkeypatch.setattr(head_start, "UNSERVED_RETRY_S", 0.3)
        with channel(addr) as ch:
            starts.start(addr, internal_pb2_grpc.PrefillStub(ch), req, [])
            wait_until(lambda: not starts.wants(addr, req), what="the prefill marked as not serving Start")
            assert starts.wants("another:1", req)
            wait_until(lambda: starts.wants(addr, req), what="the prefill asked again")
    finally:
        server.stop(None)
