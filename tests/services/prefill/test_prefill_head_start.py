"""The router's head start on a real prefill process (`pdserve.prefill.head_start`): `Prefill.Start` puts a request
in the engine before decode's stream exists; the stream naming its id and key takes it over (the same pages and first
token as computing it there); a stream that differs computes anew; a start no stream takes is freed; bad starts
get a status."""

from __future__ import annotations

import os
import queue
import time

import grpc
import pytest
import torch
from services_testutil import running_service

from pdserve.engine.loader import model_fingerprint
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

PAGE, CHUNK, WAIT_S, LIMIT = 4, 8, 1.5, 3
HELD_S = 0.3  # how long a test keeps a started request waiting before its stream comes


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    """A prefill whose head starts wait WAIT_S, at most LIMIT at once; and its answer to a Start before any stream
    has told it what decode asks for."""
    work = tmp_path_factory.mktemp("prefill-hs")
    model = build_checkpoint(work / "ckpt", arch="llama", seed=3)
    args = ["--model", str(model), "--page-size", str(PAGE), "--chunk-size", str(CHUNK), "--num-pages", "400"]
    args += ["--head-start-wait-s", str(WAIT_S), "--head-start-limit", str(LIMIT), "--torch-threads", "1"]
    # pages are compared between a stream's own request and one it took over: both take the prompt's prefix from the
    # (in-process) prompt cache, none from the pool's prefixes
    args += ["--prefix-reuse", "false"]
    with running_service("prefill", args, work) as addr, channel(addr) as ch:
        stub = internal_pb2_grpc.PrefillStub(ch)
        before = stub.Start(start("cold", prompt(10, 1)), timeout=10)
        yield stub, model_fingerprint(str(model)), before


def layout() -> KVLayoutSpec:
    return KVLayoutSpec(dtype="int8", page_size=PAGE, num_layers=2, num_kv_heads=2, head_dim=16, group_size=16)


def prompt(n: int, salt: int) -> list[int]:
    return [5 + (7 * i + 13 * salt) % 397 for i in range(n)]


SAMPLING = generate_pb2.SamplingParams(temperature=0)


def start(rid: str, ids: list[int], key: bytes = b"k" * 16) -> internal_pb2.PrefillStart:
    return internal_pb2.PrefillStart(request_id=rid, prompt_token_ids=ids, sampling=SAMPLING, start_key=key)


def request(fp: str, rid: str, ids: list[int], key: bytes = b"") -> internal_pb2.PrefillClientMessage:
    return internal_pb2.PrefillClientMessage(
        request=internal_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=SAMPLING,
            kv_layout=layout().to_proto(),
            model_fingerprint=fp,
            first_token_early=True,
            kv_layer_groups=True,
            start_key=key,
        )
    )


def stream(stub, first: internal_pb2.PrefillClientMessage) -> tuple[dict[int, bytes], internal_pb2.PrefillDone]:
    """Run a Prefill stream to its end (acking every batch): page index -> its bytes, and PrefillDone."""
    acks: queue.Queue = queue.Queue()

    def client():
        yield first
        while (item := acks.get()) is not None:
            yield item

    fmt, pages, done = PageFormat(layout()), {}, None
    try:
        for msg in stub.Prefill(client(), timeout=60):
            if msg.HasField("batch"):
                h = msg.batch.header
                assert h.layer_count in (0, 2)  # whole pages (--kv-layer-group 4 >= the model's 2 layers)
                rows = torch.frombuffer(bytearray(msg.batch.payload), dtype=torch.uint8).view(-1, fmt.page_bytes)
                for page in fmt.payloads(rows, list(h.page_indexes), list(h.num_tokens)):  # their valid tokens
                    assert page.scales is not None
                    pages[page.page_index] = page.data.numpy().tobytes() + page.scales.numpy().tobytes()
                last = h.first_seq_no + len(h.page_indexes) - 1
                acks.put(internal_pb2.PrefillClientMessage(ack=internal_pb2.KVAck(seq_no=last)))
            elif msg.HasField("done"):
                done = msg.done
    finally:
        acks.put(None)
    assert done is not None
    return pages, done


def settled(stub, fp: str, rid: str, ids: list[int]) -> tuple[dict[int, bytes], internal_pb2.PrefillDone]:
    """`stream` of a plain request for `ids` once the prompt cache holds its prefix (every full page before the
    last token: the write-back is asynchronous), so that any later request for `ids` starts from the same pages."""
    cached = (len(ids) - 1) // PAGE * PAGE
    for attempt in range(50):
        pages, done = stream(stub, request(fp, f"{rid}.{attempt}", ids))
        if done.cached_tokens == cached:
            return pages, done
        time.sleep(0.1)
    raise AssertionError(f"the prompt cache never held the {cached} tokens of {rid}'s prefix")


def all_free(stub, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = stub.Stats(internal_pb2.StatsRequest(), timeout=5)
        if s.kv_pages_free == s.kv_pages_total and s.active_requests == 0:
            return True
        time.sleep(0.05)
    return False


def test_no_head_start_before_a_stream_told_what_decode_asks_for(prefill):
    _, _, before = prefill
    assert not before.started and "no decode stream served yet" in before.reason


@pytest.mark.parametrize("n", [1, CHUNK, 3 * CHUNK + 1])
def test_stream_takes_over_the_started_request(prefill, n):
    """The same pages and first token as computing the prompt in the stream (its cached prefix too); PrefillDone's
    prefill_ms counts from the Start (the request waited HELD_S in the engine: it was not computed again)."""
    stub, fp, _ = prefill
    ids = prompt(n, n)
    computed, done = settled(stub, fp, f"plain{n}", ids)
    key = os.urandom(16)
    assert stub.Start(start(f"hs{n}", ids, key), timeout=10).started
    time.sleep(HELD_S)
    taken, taken_done = stream(stub, request(fp, f"hs{n}", ids, key))
    assert taken == computed and len(taken) == -(-n // PAGE)
    assert taken_done.first_token_id == done.first_token_id and taken_done.num_pages == done.num_pages
    assert taken_done.cached_tokens == done.cached_tokens == (n - 1) // PAGE * PAGE
    assert taken_done.prefill_ms >= HELD_S * 1e3 > done.prefill_ms
    assert all_free(stub)


def test_another_key_cannot_take_it_and_the_start_expires(prefill):
    """Only the key the router gave decode takes a start over: a stream with the same id and another key is a
    duplicate of a request in flight. Unclaimed, the start is freed after --head-start-wait-s; the id is free then."""
    stub, fp, _ = prefill
    ids = prompt(20, 1)
    assert stub.Start(start("keyed", ids, b"a" * 16), timeout=10).started
    with pytest.raises(grpc.RpcError) as err:
        stream(stub, request(fp, "keyed", ids, b"b" * 16))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert all_free(stub, WAIT_S + 5)
    pages, done = stream(stub, request(fp, "keyed", ids, b"a" * 16))  # expired: computed by the stream
    assert len(pages) == 5 and done.prefill_ms < WAIT_S * 1e3
    assert all_free(stub)


def test_a_stream_that_differs_drops_the_start_and_computes_its_own(prefill):
    stub, fp, _ = prefill
    ids, other = prompt(17, 2), prompt(17, 3)
    expected, expected_done = settled(stub, fp, "other-plain", other)
    assert stub.Start(start("differs", ids, b"d" * 16), timeout=10).started
    time.sleep(HELD_S)
    got, done = stream(stub, request(fp, "differs", other, b"d" * 16))
    assert got == expected and done.first_token_id == expected_done.first_token_id
    assert done.prefill_ms < HELD_S * 1e3  # computed by the stream, not taken over
    # other sampling, same prompt: dropped as well
    assert stub.Start(start("sampled", ids, b"s" * 16), timeout=10).started
    time.sleep(HELD_S)
    msg = request(fp, "sampled", ids, b"s" * 16)
    msg.request.sampling.temperature = 0.5
    msg.request.sampling.seed = 7
    _, done = stream(stub, msg)
    assert done.prefill_ms < HELD_S * 1e3
    assert all_free(stub)


def test_at_most_the_limit_wait_and_unclaimed_ones_are_freed(prefill):
    stub, _, _ = prefill
    replies = [stub.Start(start(f"many{i}", prompt(30, i)), timeout=10) for i in range(LIMIT + 1)]
    assert [r.started for r in replies] == [True] * LIMIT + [False]
    assert "already wait" in replies[-1].reason
    assert not all_free(stub, 0.1)  # they hold their pages while they wait
    assert all_free(stub, WAIT_S + 5)


def test_a_start_the_engine_refuses_leaves_the_stream_its_status(prefill):
    """Prompt checks are the engine's: a Start is queued before them, and its stream then gets the engine's status
    for the same request (not a hang, not a leak)."""
    stub, fp, _ = prefill
    bad = [5, 6, 10**6]  # outside the vocabulary
    assert stub.Start(start("bad", bad, b"x" * 16), timeout=10).started
    with pytest.raises(grpc.RpcError) as err:
        stream(stub, request(fp, "bad", bad, b"x" * 16))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.value.details()
    assert all_free(stub)


@pytest.mark.parametrize(
    "mutate",
    [lambda m: setattr(m, "start_key", b"short"), lambda m: setattr(m, "request_id", "")],
)
def test_malformed_starts_are_invalid_argument(prefill, mutate):
    stub, _, _ = prefill
    msg = start("malformed", prompt(4, 0))
    mutate(msg)
    with pytest.raises(grpc.RpcError) as err:
        stub.Start(msg, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
