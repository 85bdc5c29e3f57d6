"""The Prefill bidi stream, driven directly: pages stream while prefill still runs, protocol errors get a status,
and pages are freed on ack and on abandonment."""

from __future__ import annotations

import queue
import time

import grpc
import pytest
import torch
from services_testutil import running_service

from pdserve.engine.loader import model_fingerprint
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.handshake import make_offer
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.wire import BatchExpectation, verify_header
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc, kv_pb2

PAGE, CHUNK = 4, 8


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    work = tmp_path_factory.mktemp("prefill")
    model = build_checkpoint(work / "ckpt", arch="llama", seed=3)
    args = ["--model", str(model), "--page-size", str(PAGE), "--chunk-size", str(CHUNK), "--num-pages", "600"]
    with running_service("prefill", [*args, "--torch-threads", "1"], work) as addr, channel(addr) as ch:
        yield internal_pb2_grpc.PrefillStub(ch), model_fingerprint(str(model))


def layout(dtype="int8") -> KVLayoutSpec:
    return KVLayoutSpec(
        dtype=dtype, page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=16, group_size=16 if dtype == "int8" else 0
    )


def request(fp: str, n: int, dtype="int8", rid="r") -> internal_pb2.PrefillClientMessage:
    return internal_pb2.PrefillClientMessage(
        request=internal_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=[5 + i % 400 for i in range(n)],
            sampling=generate_pb2.SamplingParams(temperature=0),
            kv_layout=layout(dtype).to_proto(),
            model_fingerprint=fp,
        )
    )


def free_pages(stub) -> tuple[int, int]:
    s = stub.Stats(internal_pb2.StatsRequest(), timeout=5)
    return s.kv_pages_free, s.kv_pages_total


def wait_all_free(stub, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        free, total = free_pages(stub)
        if free == total:
            return True
        time.sleep(0.05)
    return False


def test_pages_stream_while_prefill_runs_and_ack_frees(prefill):
    stub, fp = prefill
    n = 1000  # 125 chunks of 8 tokens (context is 1024)
    acks: queue.Queue = queue.Queue()

    def client():
        yield request(fp, n)
        while (item := acks.get()) is not None:
            yield item

    batch_sizes, pages = [], []
    done = None
    call = stub.Prefill(client(), timeout=120)
    choice = None
    for msg in call:
        if msg.HasField("transport"):  # always first: no offer in the request, so grpc
            assert choice is None and not pages
            choice = msg.transport
        elif msg.HasField("batch"):  # a standard protobuf reader parses the pre-serialized batch
            batch_sizes.append(len(msg.batch.header.page_indexes))
            h, payload = msg.batch.header, msg.batch.payload
            verify_header(h, BatchExpectation(layout(), fp, "r"), payload)
            assert h.first_seq_no == len(pages)
            fmt = PageFormat(layout())
            rows = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(-1, fmt.page_bytes)
            pages.extend(fmt.payloads(rows, list(h.page_indexes), list(h.num_tokens)))
            last = h.first_seq_no + len(h.page_indexes) - 1
            acks.put(internal_pb2.PrefillClientMessage(ack=internal_pb2.KVAck(seq_no=last)))
        else:
            done = msg.done
    acks.put(None)
    assert choice is not None and choice.transport == "grpc"
    assert done is not None and done.num_pages == len(pages) == -(-n // PAGE)
    assert [p.page_index for p in pages] == list(range(len(pages)))
    assert pages[-1].num_tokens == n - (len(pages) - 1) * PAGE
    # Streaming, not store-and-forward: each chunk's pages leave in their own batch right after the chunk (the
    # engine thread exports them, the stream writer ships them while the next chunk computes). Store-and-forward
    # would send all 250 pages (~150 KB) in one message of up to --kv-batch-mb.
    assert batch_sizes[0] == CHUNK // PAGE and len(batch_sizes) == -(-n // CHUNK), batch_sizes[:5]
    assert wait_all_free(stub)


def test_duplicate_id_in_flight_is_refused_and_leaves_the_first_alone(prefill):
    """A second stream with the id of one still in flight fails ALREADY_EXISTS, and the first is untouched: it
    streams every page and finishes at once (the rejected duplicate once freed the first one's engine request).

    The first stream is held in flight deterministically: it asks for cuda-ipc (a shared-memory staging buffer on
    CPU), so prefill waits for decode's readiness answer before shipping anything and the request stays in the
    engine however fast its prefill computes. The test answers "ready" only after the duplicate was refused."""
    stub, fp = prefill
    acks: queue.Queue = queue.Queue()
    first = request(fp, 1000, rid="twice")
    first.request.kv_transport.CopyFrom(make_offer("cuda-ipc", torch.device("cpu")))

    def client():
        yield first
        while (item := acks.get()) is not None:
            yield item

    call = stub.Prefill(client(), timeout=30)
    try:
        choice = next(call)  # sent once the request is in the engine
        assert choice.HasField("transport") and choice.transport.transport == "cuda-ipc", choice
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Prefill(iter([request(fp, 12, rid="twice")]), timeout=10))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value
        ready = kv_pb2.KVTransportReady(ok=True)  # pages are counted and acked, not read
        acks.put(internal_pb2.PrefillClientMessage(transport_ready=ready))
        pages, done = 0, None
        for msg in call:
            if msg.HasField("ipc_batch"):
                header = msg.ipc_batch.header
                pages += len(header.page_indexes)
                last = header.first_seq_no + len(header.page_indexes) - 1
                acks.put(internal_pb2.PrefillClientMessage(ack=internal_pb2.KVAck(seq_no=last)))
            elif msg.HasField("done"):
                done = msg.done
    finally:
        acks.put(None)
    assert done is not None and done.num_pages == pages == 250
    assert wait_all_free(stub)


def test_abandoned_stream_frees_pages(prefill):
    stub, fp = prefill
    call = stub.Prefill(iter([request(fp, 1000, rid="gone")]), timeout=120)
    assert next(call).HasField("transport")
    assert next(call).HasField("batch")  # first pages arrived; never ack, then hang up mid-prefill
    call.cancel()
    assert wait_all_free(stub)


@pytest.mark.parametrize(
    "mutate, code, reason",
    [
        (
            lambda m: setattr(m.request, "model_fingerprint", "other"),
            grpc.StatusCode.FAILED_PRECONDITION,
            "fingerprint",
        ),
        (lambda m: m.request.kv_layout.__setattr__("head_dim", 32), grpc.StatusCode.FAILED_PRECONDITION, "layout"),
        (lambda m: m.request.kv_layout.__setattr__("group_size", 5), grpc.StatusCode.FAILED_PRECONDITION, "group_size"),
        (lambda m: m.request.ClearField("prompt_token_ids"), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
        (lambda m: m.request.prompt_token_ids.append(10**6), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
        (lambda m: m.request.sampling.__setattr__("top_p", 2.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (lambda m: setattr(m.request, "sampled_before", 10), grpc.StatusCode.INVALID_ARGUMENT, "sampled_before"),
        (lambda m: setattr(m.request, "sampled_before", -1), grpc.StatusCode.INVALID_ARGUMENT, "sampled_before"),
    ],
)
def test_bad_requests_get_status(prefill, mutate, code, reason):
    stub, fp = prefill
    msg = request(fp, 10)
    mutate(msg)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Prefill(iter([msg]), timeout=30))
    assert err.value.code() == code and reason in err.value.details()


def test_first_message_must_be_request(prefill):
    stub, _ = prefill
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Prefill(iter([internal_pb2.PrefillClientMessage(ack=internal_pb2.KVAck(seq_no=0))]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def kv_stats(stub) -> dict:
    return {t.transport: t for t in stub.Stats(internal_pb2.StatsRequest(), timeout=5).kv_transports}


def test_cuda_ipc_offer_on_a_cpu_prefill_falls_back_to_grpc_counted(prefill):
    """Decode offers cuda-ipc from this host with CUDA; this prefill runs on CPU: grpc, with the reason, counted."""
    stub, fp = prefill
    before = kv_stats(stub).get("cuda-ipc")
    msg = request(fp, 10, rid="fallback")
    offer = make_offer("cuda-ipc", torch.device("cpu"))
    offer.forced, offer.device_kind = False, "cuda"
    offer.transports.append("grpc")
    msg.request.kv_transport.CopyFrom(offer)
    out = list(stub.Prefill(iter([msg]), timeout=30))  # no acks: the stream still ends after PrefillDone (grpc)
    assert out[0].transport.transport == "grpc" and "CUDA on both ends" in out[0].transport.reason
    assert out[-1].HasField("done")
    after = kv_stats(stub)["cuda-ipc"]
    assert after.fallbacks == (before.fallbacks if before else 0) + 1


def test_forced_cuda_ipc_across_hosts_is_an_error(prefill):
    stub, fp = prefill
    msg = request(fp, 10, rid="elsewhere")
    offer = make_offer("cuda-ipc", torch.device("cpu"))
    offer.host_id = "another-host/boot"
    msg.request.kv_transport.CopyFrom(offer)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Prefill(iter([msg]), timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "different hosts" in err.value.details()


def test_decode_that_cannot_open_a_forced_ipc_buffer_gets_an_error_and_pages_are_freed(prefill):
    stub, fp = prefill
    msg = request(fp, 40, rid="no-open")
    msg.request.kv_transport.CopyFrom(make_offer("cuda-ipc", torch.device("cpu")))  # forced: shm on CPU
    ready = internal_pb2.PrefillClientMessage(transport_ready=kv_pb2.KVTransportReady(ok=False, reason="test"))
    with pytest.raises(grpc.RpcError) as err:
        for m in stub.Prefill(iter([msg, ready]), timeout=30):
            assert m.HasField("transport") and m.transport.transport == "cuda-ipc"
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "test" in err.value.details()
    assert wait_all_free(stub)


def _stream_kinds(stub, first: internal_pb2.PrefillClientMessage) -> tuple[list[str], list]:
    """The kinds of the stream's messages in order (acking every batch), and its first_token / done messages."""
    acks: queue.Queue = queue.Queue()

    def client():
        yield first
        while (item := acks.get()) is not None:
            yield item

    kinds, ends = [], []
    for msg in stub.Prefill(client(), timeout=60):
        kind = msg.WhichOneof("msg")
        kinds.append(kind)
        if kind == "batch":
            h = msg.batch.header
            acks.put(
                internal_pb2.PrefillClientMessage(
                    ack=internal_pb2.KVAck(seq_no=h.first_seq_no + len(h.page_indexes) - 1)
                )
            )
        elif kind in ("first_token", "done"):
            ends.append(getattr(msg, kind))
    acks.put(None)
    return kinds, ends


@pytest.mark.parametrize("n", [1, CHUNK, 3 * CHUNK + 1])
def test_first_token_goes_ahead_of_the_last_chunks_pages(prefill, n):
    """first_token_early: PrefillFirstToken once, as soon as the last chunk computed: before that chunk's batch
    (and before whatever is left of the earlier chunks' batches), with PrefillDone's token."""
    stub, fp = prefill
    first = request(fp, n, rid=f"early{n}")
    first.request.first_token_early = True
    first.request.prompt_token_ids[:] = [7 + (13 * i + n) % 397 for i in range(n)]  # no prefix in the pool
    kinds, (ft, done) = _stream_kinds(stub, first)
    assert kinds[0] == "transport" and kinds[-2:] == ["batch", "done"] and kinds.count("first_token") == 1, kinds
    assert set(kinds[1:-2]) == {"batch", "first_token"} or kinds == ["transport", "first_token", "batch", "done"]
    assert (n <= CHUNK) == (len(kinds) == 4), kinds
    assert ft.token_id == done.first_token_id and ft.cached_tokens == done.cached_tokens == 0
    # a prompt whose prefix the pool holds now: the shared pages go with the last chunk's, after the token
    again = request(fp, n, rid=f"again{n}")
    again.request.CopyFrom(first.request)
    again.request.request_id = f"again{n}"
    kinds, (ft, done) = _stream_kinds(stub, again)
    assert kinds == ["transport", "first_token", "batch", "done"]
    assert ft.cached_tokens == done.cached_tokens == (n - 1) // PAGE * PAGE
    assert wait_all_free(stub)


def test_no_early_first_token_unasked_or_with_prompt_logprobs(prefill):
    stub, fp = prefill
    kinds, _ = _stream_kinds(stub, request(fp, 9, rid="late"))
    assert "first_token" not in kinds and kinds[-1] == "done"
    asked = request(fp, 9, rid="late-lp")
    asked.request.first_token_early = True
    asked.request.sampling.prompt_logprobs = True  # those lead the first response: they come with PrefillDone
    kinds, (done,) = _stream_kinds(stub, asked)
    assert "first_token" not in kinds and len(done.prompt_logprobs) == 8
    assert wait_all_free(stub)
