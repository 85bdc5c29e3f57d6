"""An int8 decode service against a scripted prefill instance that answers each request as a test tells it to: a
batch with NaN / inf scales under a valid checksum and a first token outside the vocabulary are refused DATA_LOSS
with every page freed (fp8 and dense decodes too, for NaN / inf page data); a caller that cancels while pages
arrive is logged as a cancellation (INFO), never as an error with a traceback."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from services_testutil import pool_empty, tiny_decode

from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.wire import batch_message_bytes
from pdserve.prefill.servicer import add_prefill_servicer
from pdserve.testing.impostors import kv_batch, serve
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, internal_pb2, kv_pb2

PAGE, PROMPT = 4, 8  # two pages


class ScriptedPrefill:
    """Sends the transport choice, then what `script[request_id]` says: ("scale", value) one batch of every page
        with one scale set to value, then PrefillDone; ("data", value) the same with one data value set to value (fp8:
        the byte `value`); ("first", token_id) finite pages, then PrefillDone with that first
        token; ("stall", None) one page, then nothing until the stream ends; ("scale-stall", value) the "scale" batch,
    then nothing until the stream ends; ("early", token_id) PrefillFirstToken, then the pages once `release_pages`
    is set, then PrefillDone with that token ("early-other": another token; "early-twice": two first tokens)."""

    def __init__(self):
        self.script: dict[str, tuple[str, float | int | None]] = {}
        self.stalled = threading.Event()  # the stalled stream's page went out
        self.ended = threading.Event()  # ... and its stream ended
        self.ended_rids: set[str] = set()  # "scale-stall" streams that decode ended
        self.early_sent = threading.Event()  # an "early*" stream's first token went out ...
        self.release_pages = threading.Event()  # ... and its pages wait for this

    def Prefill(self, request_iterator, context):
        req = next(request_iterator).request
        kind, value = self.script[req.request_id]
        lay = KVLayoutSpec.from_proto(req.kv_layout)
        fmt = PageFormat(lay)
        n = -(-len(req.prompt_token_ids) // lay.page_size)
        data = torch.zeros(n, *fmt.data_shape, dtype=lay.torch_dtype)
        scales = torch.full((n, *fmt.scales_shape), 0.01, dtype=torch.float16) if lay.quantized else None
        if kind in ("scale", "scale-stall"):
            assert scales is not None
            scales[n - 1, 1, 0, 0, 0, 0] = value
        if kind == "data" and lay.dtype == "fp8":
            data.view(torch.uint8)[n - 1, 1, 0, 0, 0, 0] = int(value)
        elif kind == "data":
            data[n - 1, 1, 0, 0, 0, 0] = value
        header, payload = kv_batch(req, fmt, data, scales, None, list(range(n)) if kind != "stall" else [0])
        ended = threading.Event()  # this RPC ended (decode cancelled it)
        if kind == "scale-stall":  # recorded by the callback: when decode cancels before the server saw its last
            # send complete, gRPC never resumes this generator, so code after the yield would not run
            if not context.add_callback(lambda rid=req.request_id: (self.ended_rids.add(rid), ended.set())):
                return
        yield internal_pb2.PrefillServerMessage(transport=kv_pb2.KVTransportChoice(transport="grpc"))
        if kind.startswith("early"):  # the first token ahead of the pages, which wait for the test's word
            assert req.first_token_early
            early = internal_pb2.PrefillFirstToken(token_id=int(value or 7), cached_tokens=3)
            for _ in range(2 if kind == "early-twice" else 1):
                yield internal_pb2.PrefillServerMessage(first_token=early)
            self.early_sent.set()
            assert self.release_pages.wait(30)
            if kind == "early-other":
                value = int(value or 7) + 1
        yield batch_message_bytes(header, payload)
        if kind == "stall":
            self.stalled.set()
            ended = threading.Event()
            if not context.add_callback(ended.set):  # the RPC ended already (decode cancelled it at once)
                ended.set()
            ended.wait(60)
            self.ended.set()
            return
        if kind == "scale-stall":  # the bad batch, then silence: only decode can end the stream
            ended.wait(60)
            return
        first = int(value) if kind in ("first", "early", "early-other") and value is not None else 7
        yield internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(first_token_id=first, num_pages=n))

    def Stats(self, request, context):
        return internal_pb2.InstanceStats()


@pytest.fixture(scope="module")
def scripted():
    servicer = ScriptedPrefill()
    addr, server = serve(lambda s: add_prefill_servicer(servicer, s))  # type: ignore[arg-type]  # Prefill, Stats
    yield addr, servicer
    server.stop(0)


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    work = tmp_path_factory.mktemp("decode-hostile")
    flags = ["--log-level", "INFO", "--gil-switch-interval-us", "300"]
    with tiny_decode(work, page_size=PAGE, kv_dtype="int8", extra=flags) as stub:
        yield stub, next(Path(work).glob("decode*.log"))


def test_the_process_runs_at_its_gil_switch_interval(decode):
    _, log = decode
    assert "GIL switch interval: 300 us" in log.read_text()  # pdserve.server.gil, set as the engine is built


@pytest.fixture(scope="module", params=["fp8", "auto"])
def float_decode(request, tmp_path_factory):
    """A decode whose pool holds float values: fp8 e4m3 or the model dtype (float32 on CPU)."""
    work = tmp_path_factory.mktemp(f"decode-hostile-{request.param}")
    with tiny_decode(work, page_size=PAGE, kv_dtype=request.param) as stub:
        yield stub, request.param


def generate(stub, target: str, rid: str, max_tokens: int = 4):
    req = internal_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=[5 + i for i in range(PROMPT)],
        prefill_target=target,
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    return stub.Generate(req, timeout=30)


@pytest.mark.parametrize(
    "kind, value, reason",
    [
        ("scale", math.nan, "NaN or infinity"),  # a batch with a non-finite scale under a valid checksum
        ("scale", math.inf, "NaN or infinity"),
        ("scale", -math.inf, "NaN or infinity"),
        ("first", 10**6, "outside the vocabulary"),  # PrefillDone's first token
        ("first", -1, "outside the vocabulary"),
    ],
)
def test_damaged_prefill_answers_are_data_loss(decode, scripted, kind, value, reason):
    stub, _ = decode
    target, prefill = scripted
    rid = f"{kind}-{value}"
    prefill.script[rid] = (kind, value)
    with pytest.raises(grpc.RpcError) as err:
        list(generate(stub, target, rid))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS, err.value
    assert reason in err.value.details()
    wait_until(lambda: pool_empty(stub), what="decode pages freed")


def test_a_bad_batch_is_data_loss_at_once_even_when_prefill_goes_silent(decode, scripted):
    """Batches are checked off the stream's reader: a bad one cancels the Prefill call, so decode answers DATA_LOSS
    without waiting for another message (here none comes) or for page_timeout_s."""
    stub, _ = decode
    target, prefill = scripted
    prefill.script["bad-then-silent"] = ("scale-stall", math.nan)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(generate(stub, target, "bad-then-silent"))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "NaN or infinity" in err.value.details(), err.value
    assert time.monotonic() - t0 < 10  # page_timeout_s is 30
    wait_until(lambda: "bad-then-silent" in prefill.ended_rids, what="decode ended the Prefill stream")
    wait_until(lambda: pool_empty(stub), what="decode pages freed")


def test_unusable_page_data_is_data_loss_on_fp8_and_dense_decodes(float_decode, scripted):
    """NaN / inf in dense pages, a NaN encoding in fp8 pages: under a valid checksum, refused DATA_LOSS, pages freed;
    the same pages with finite data generate."""
    stub, kv_dtype = float_decode
    target, prefill = scripted
    bad = [0x7F, 0xFF] if kv_dtype == "fp8" else [math.nan, math.inf, -math.inf]
    for i, value in enumerate(bad):
        rid = f"data-{kv_dtype}-{i}"
        prefill.script[rid] = ("data", value)
        with pytest.raises(grpc.RpcError) as err:
            list(generate(stub, target, rid))
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "NaN" in err.value.details(), err.value
        wait_until(lambda: pool_empty(stub), what="decode pages freed")
    prefill.script[f"data-{kv_dtype}-ok"] = ("data", 0x7E if kv_dtype == "fp8" else 1.5)  # fp8 0x7E: 448, a value
    out = list(generate(stub, target, f"data-{kv_dtype}-ok"))
    assert sum(len(m.token_ids) for m in out) == 4
    wait_until(lambda: pool_empty(stub), what="decode pages freed")


def test_the_same_pages_with_finite_scales_generate(decode, scripted):
    """The control: the scripted pages themselves are acceptable (so the refusals above are the scales')."""
    stub, _ = decode
    target, prefill = scripted
    prefill.script["finite"] = ("scale", 0.02)
    out = list(generate(stub, target, "finite"))
    assert out[-1].finish_reason and sum(len(m.token_ids) for m in out) == 4
    wait_until(lambda: pool_empty(stub), what="decode pages freed")


def test_cancel_during_the_transfer_is_info_not_an_error(decode, scripted):
    stub, log = decode
    target, prefill = scripted
    prefill.script["cancelled"] = ("stall", None)
    call = generate(stub, target, "cancelled")
    assert prefill.stalled.wait(10)
    call.cancel()
    assert prefill.ended.wait(10), "decode did not end the prefill stream after its caller cancelled"
    line = wait_until(
        lambda: next((x for x in log.read_text().splitlines() if "rid=cancelled caller went away" in x), None),
        what="the cancellation logged",
    )
    assert " INFO " in line
    wait_until(lambda: "decode rid=cancelled" in log.read_text(), what="the request's summary line")
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
    wait_until(lambda: pool_empty(stub), what="decode pages freed")


@pytest.mark.parametrize("max_tokens", [4, 1])
def test_first_token_streams_before_the_pages(decode, scripted, max_tokens):
    """PrefillFirstToken reaches the caller while prefill still holds every page; the rest follows once they are
    in. A first token that ends the request (max_tokens 1) is the final response at once, and its stream still
    ends normally when the pages arrive (prefill finishes and may write its cache)."""
    stub, _ = decode
    target, prefill = scripted
    prefill.early_sent.clear()
    prefill.release_pages.clear()
    rid = f"early-{max_tokens}"
    prefill.script[rid] = ("early", 9)
    call = generate(stub, target, rid, max_tokens=max_tokens)
    first = next(call)  # prefill has sent no page yet: it waits for release_pages
    assert not prefill.release_pages.is_set() and list(first.token_ids) == [9]
    assert bool(first.finish_reason) == (max_tokens == 1)
    if max_tokens == 1:
        assert first.usage.completion_tokens == 1 and first.usage.cached_tokens == 3
    prefill.release_pages.set()
    rest = list(call)
    assert sum(len(m.token_ids) for m in [first, *rest]) == max_tokens and [first, *rest][-1].finish_reason
    wait_until(lambda: pool_empty(stub), what="decode pages freed")


@pytest.mark.parametrize("kind, reason", [("early-other", "differs"), ("early-twice", "twice")])
def test_inconsistent_early_first_token_is_data_loss(decode, scripted, kind, reason):
    stub, _ = decode
    target, prefill = scripted
    prefill.release_pages.set()
    prefill.script[kind] = (kind, 9)
    with pytest.raises(grpc.RpcError) as err:
        list(generate(stub, target, kind))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and reason in err.value.details(), err.value
    wait_until(lambda: pool_empty(stub), what="decode pages freed")
