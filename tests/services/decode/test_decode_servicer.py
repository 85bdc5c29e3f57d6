"""The decode service driven directly, with a stand-in prefill instance: bad resume fields get INVALID_ARGUMENT
and leave no page held; a prefill that goes silent fails the request after page_timeout_s (DEADLINE_EXCEEDED),
its pages freed."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from services_testutil import pool_empty, tiny_decode

from pdserve.testing.impostors import serve
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

PAGE, PAGE_TIMEOUT_S = 4, 0.5


class SilentPrefill(internal_pb2_grpc.PrefillServicer):
    """Takes the request and never sends a page (a stuck prefill instance)."""

    def __init__(self):
        self.requests: list[internal_pb2.PrefillRequest] = []
        self.ended: dict[str, threading.Event] = {}  # request id -> set when its call ended

    def Prefill(self, request_iterator, context):
        request = next(request_iterator).request
        ended = self.ended.setdefault(request.request_id, threading.Event())
        self.requests.append(request)
        context.add_callback(ended.set)
        ended.wait(60)
        return iter(())


@pytest.fixture(scope="module")
def silent_prefill():
    servicer = SilentPrefill()
    addr, server = serve(lambda s: internal_pb2_grpc.add_PrefillServicer_to_server(servicer, s))
    yield addr, servicer
    server.stop(0)


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    work = tmp_path_factory.mktemp("decode")
    with tiny_decode(work, page_size=PAGE, kv_dtype="auto", extra=["--page-timeout-s", str(PAGE_TIMEOUT_S)]) as stub:
        yield stub


def decode_request(
    target: str, rid: str, resumed_tokens: int = 0, resumed_text_chars: int = 0, n: int = 8
) -> internal_pb2.DecodeRequest:
    return internal_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=[5 + i for i in range(n)],
        prefill_target=target,
        sampling=generate_pb2.SamplingParams(max_tokens=6, temperature=0.0),
        resumed_tokens=resumed_tokens,
        resumed_text_chars=resumed_text_chars,
    )


def test_stats_report_the_page_size(decode):
    assert decode.Stats(internal_pb2.StatsRequest(), timeout=5).page_size == PAGE


@pytest.mark.parametrize(
    "resumed_tokens, resumed_text_chars, reason",
    [
        (8, 0, "resumed_tokens"),  # the whole prompt
        (-1, 0, "resumed_tokens"),
        (2, -5, "resumed_text_chars"),
        (2, 10_000, "resumed_text_chars"),  # more text delivered than the resumed tokens make
        (6, 0, "resumed_tokens"),  # >= max_tokens: the request had finished
        (0, 3, "resumed_text_chars"),  # text delivered without resumed tokens
    ],
)
def test_bad_resume_fields_invalid_argument_and_no_pages_held(
    decode, silent_prefill, resumed_tokens, resumed_text_chars, reason
):
    target, _ = silent_prefill
    req = decode_request(
        target, f"bad-resume-{resumed_tokens}-{resumed_text_chars}", resumed_tokens, resumed_text_chars
    )
    with pytest.raises(grpc.RpcError) as err:
        list(decode.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()
    wait_until(lambda: pool_empty(decode), what="decode pages freed")


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda r: r.ClearField("prefill_target"), "prefill_target"),
        (lambda r: r.ClearField("prompt_token_ids"), "empty"),
        (lambda r: r.prompt_token_ids.append(10**6), "vocabulary"),
        (lambda r: r.sampling.__setattr__("top_p", 0.0), "top_p"),
    ],
)
def test_bad_requests_invalid_argument(decode, silent_prefill, mutate, reason):
    req = decode_request(silent_prefill[0], f"bad-{reason}")
    mutate(req)
    with pytest.raises(grpc.RpcError) as err:
        list(decode.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()
    wait_until(lambda: pool_empty(decode), what="decode pages freed")


def test_a_reservation_that_fails_after_the_prefill_stream_opened_cancels_it(decode, silent_prefill):
    """The Prefill stream opens while the page reservation waits for the engine thread (the pool has room): a
    request the engine then refuses gets INVALID_ARGUMENT and its Prefill call ends at once."""
    target, servicer = silent_prefill
    req = decode_request(target, "refused-after-open")
    req.prompt_token_ids.append(10**6)  # outside the vocabulary: begin_import refuses it
    with pytest.raises(grpc.RpcError) as err:
        list(decode.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.value.details()
    time.sleep(0.5)  # a stand-in handler the cancellation overtook may still start
    if "refused-after-open" in servicer.ended:  # the stream reached the stand-in (a race with the refusal)
        assert servicer.ended["refused-after-open"].wait(5), "the Prefill call was not cancelled"
    wait_until(lambda: pool_empty(decode), what="decode pages freed")


def test_silent_prefill_fails_after_page_timeout_and_frees_pages(decode, silent_prefill):
    target, servicer = silent_prefill
    with pytest.raises(grpc.RpcError) as err:
        list(decode.Generate(decode_request(target, "stuck", n=30), timeout=30))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    assert "page_timeout_s" in err.value.details()  # decode's own bound, not the caller's 30 s deadline
    assert any(r.request_id == "stuck" for r in servicer.requests)  # the request did reach prefill
    wait_until(lambda: pool_empty(decode), what="decode pages freed")


class HoldingPrefill(internal_pb2_grpc.PrefillServicer):
    """Takes each call's request and holds the call open, sending nothing, until that call ends."""

    def __init__(self):
        self.seen: list[str] = []

    def Prefill(self, request_iterator, context):
        self.seen.append(next(request_iterator).request.request_id)
        ended = threading.Event()
        context.add_callback(ended.set)
        ended.wait(60)
        return iter(())


def test_a_refused_duplicate_id_leaves_the_call_that_holds_it_alone(tmp_path):
    """A second Generate with the id of one in flight gets ALREADY_EXISTS, and the first call's engine request
    keeps its pages: the refused call's cleanup must not abort an engine request that was never its own."""
    holder = HoldingPrefill()
    addr, server = serve(lambda s: internal_pb2_grpc.add_PrefillServicer_to_server(holder, s))
    try:
        with tiny_decode(tmp_path, page_size=PAGE, kv_dtype="auto", extra=["--page-timeout-s", "30"]) as stub:
            first = stub.Generate(decode_request(addr, "twice", n=12), timeout=60)
            outcome: list = []
            reader = threading.Thread(target=_drain, args=(first, outcome))
            reader.start()
            wait_until(lambda: "twice" in holder.seen and not pool_empty(stub), what="first call in flight")
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(decode_request(addr, "twice", n=8), timeout=10))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value
            time.sleep(0.5)  # an abort the refused call queued runs on the engine thread within this
            assert reader.is_alive() and not pool_empty(stub), "the first call's engine request was freed"
            first.cancel()
            reader.join(10)
            wait_until(lambda: pool_empty(stub), what="decode pages freed")
    finally:
        server.stop(0)


def _drain(call, outcome: list) -> None:
    try:
        outcome.extend(call)
    except grpc.RpcError as e:
        outcome.append(e.code())
