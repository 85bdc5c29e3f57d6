"""Prefill bounds how long decode may leave a shipped page unacknowledged (ack_timeout_s): a receiver that reads
pages but never acks gets DEADLINE_EXCEEDED with the reason, and the pages are freed."""

from __future__ import annotations

import time

import grpc
import pytest
from services_testutil import running_service

from pdserve.engine.loader import model_fingerprint
from pdserve.kv.codec import KVLayoutSpec
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

PAGE, CHUNK, ACK_TIMEOUT_S = 4, 8, 0.05


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    work = tmp_path_factory.mktemp("prefill-ack")
    model = build_checkpoint(work / "ckpt", arch="llama", seed=3)
    args = ["--model", str(model), "--page-size", str(PAGE), "--chunk-size", str(CHUNK), "--num-pages", "600"]
    args += ["--torch-threads", "1", "--ack-timeout-s", str(ACK_TIMEOUT_S)]
    with running_service("prefill", args, work) as addr, channel(addr) as ch:
        yield internal_pb2_grpc.PrefillStub(ch), model_fingerprint(str(model))


def test_unacknowledged_pages_end_the_stream_and_are_freed(prefill):
    stub, fp = prefill
    layout = KVLayoutSpec(dtype="int8", page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=16, group_size=16)
    first = internal_pb2.PrefillClientMessage(
        request=internal_pb2.PrefillRequest(
            request_id="no-acks",
            prompt_token_ids=[5 + i % 400 for i in range(1000)],  # 125 chunks, 250 pages
            sampling=generate_pb2.SamplingParams(temperature=0),
            kv_layout=layout.to_proto(),
            model_fingerprint=fp,
        )
    )
    pages = 0
    with pytest.raises(grpc.RpcError) as err:
        for msg in stub.Prefill(iter([first]), timeout=120):  # reads every page, acks none
            assert not msg.HasField("done"), "prefill finished although no page was ever acknowledged"
            pages += 1
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    assert "ack_timeout_s" in err.value.details() and "acknowledged 0 of" in err.value.details()
    assert 0 < pages < 250
    deadline = time.monotonic() + 10
    while (s := stub.Stats(internal_pb2.StatsRequest(), timeout=5)).kv_pages_free != s.kv_pages_total:
        assert time.monotonic() < deadline, "pages still held after the stream ended"
        time.sleep(0.05)
