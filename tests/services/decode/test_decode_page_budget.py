"""A decode service (a process) against a paced stand-in prefill instance whose "engine step" takes longer than
--page-timeout-s (issue 35 item 4): a long prompt's second chunk and a short request batched in the same step both
complete, since the page wait scales with the prompt tokens still awaited from that instance at the rate they
arrived; a prefill that then goes silent still fails the request DEADLINE_EXCEEDED, within the scaled bound, with
its pages freed."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from services_testutil import pool_empty, tiny_decode

from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.transfer.page_format import PageFormat
from pdserve.kv.transfer.wire import batch_message_bytes, make_header
from pdserve.prefill.servicer import add_prefill_servicer
from pdserve.testing.impostors import serve
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, internal_pb2, kv_pb2

PAGE, LONG, SHORT = 4, 64, 4  # the long prompt: two chunks of 8 pages
FLOOR_S, FIRST_CHUNK_S, STEP_S = 0.5, 0.4, 1.2  # the second step takes 2.4x page_timeout_s


class PacedPrefill:
    """Stands in for a prefill instance. "long-*": the transport choice, the first chunk's 8 pages after
    FIRST_CHUNK_S, then one step of STEP_S computing the second chunk with the matching "short-*" prompt (which
    arrives during it), whose pages both go out after it ("long-stall": nothing after the first chunk until decode
    ends the stream)."""

    def __init__(self):
        self.mate_in: dict[str, threading.Event] = {}  # suffix -> the short request arrived
        self.step_done: dict[str, threading.Event] = {}  # suffix -> the shared step finished
        self.ended = threading.Event()  # the stalled stream ended (decode cancelled it)

    def events(self, suffix: str) -> tuple[threading.Event, threading.Event]:
        return self.mate_in.setdefault(suffix, threading.Event()), self.step_done.setdefault(suffix, threading.Event())

    def Prefill(self, request_iterator, context):
        req = next(request_iterator).request
        kind, suffix = req.request_id.split("-", 1)
        mate_in, step_done = self.events(suffix)
        lay = KVLayoutSpec.from_proto(req.kv_layout)
        n = -(-len(req.prompt_token_ids) // lay.page_size)
        yield internal_pb2.PrefillServerMessage(transport=kv_pb2.KVTransportChoice(transport="grpc"))
        if kind == "short":
            mate_in.set()
            assert step_done.wait(30)
            yield batch(req, lay, 0, list(range(n)))
        else:
            time.sleep(FIRST_CHUNK_S)
            yield batch(req, lay, 0, list(range(n // 2)))
            if suffix == "stall":
                ended = threading.Event()
                if not context.add_callback(ended.set):  # the RPC ended already
                    ended.set()
                ended.wait(60)
                self.ended.set()
                return
            step_end = time.monotonic() + STEP_S  # the step computing the long prompt's second chunk and the short one
            assert mate_in.wait(STEP_S), "the short request did not arrive during the step"
            time.sleep(max(0.0, step_end - time.monotonic()))
            step_done.set()
            yield batch(req, lay, n // 2, list(range(n // 2, n)))
        yield internal_pb2.PrefillServerMessage(done=internal_pb2.PrefillDone(first_token_id=7, num_pages=n))

    def Stats(self, request, context):
        return internal_pb2.InstanceStats()


def batch(req: internal_pb2.PrefillRequest, lay: KVLayoutSpec, first_seq_no: int, pages: list[int]) -> bytes:
    """One batch of finite float pages (the decode's pool format: kv_dtype auto)."""
    fmt = PageFormat(lay)
    data = torch.full((len(pages), *fmt.data_shape), 0.5, dtype=lay.torch_dtype)
    payload = fmt.pack(data, None, None).contiguous().numpy().tobytes()
    size, prompt = lay.page_size, len(req.prompt_token_ids)
    header = make_header(
        request_id=req.request_id,
        fingerprint=req.model_fingerprint,
        layout=lay,
        first_seq_no=first_seq_no,
        page_indexes=pages,
        num_tokens=[min(size, prompt - i * size) for i in pages],
        payload=payload,
    )
    return batch_message_bytes(header, payload)


@pytest.fixture(scope="module")
def paced():
    servicer = PacedPrefill()
    addr, server = serve(lambda s: add_prefill_servicer(servicer, s))  # type: ignore[arg-type]  # Prefill, Stats
    yield addr, servicer
    server.stop(0)


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    work = tmp_path_factory.mktemp("decode-budget")
    flags = ["--page-timeout-s", str(FLOOR_S), "--page-timeout-max-s", "10", "--page-timeout-slack", "5"]
    with tiny_decode(work, page_size=PAGE, kv_dtype="auto", extra=flags) as stub:
        yield stub


def generate(stub, target: str, rid: str, n: int):
    req = internal_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=[5 + i % 100 for i in range(n)],
        prefill_target=target,
        sampling=generate_pb2.SamplingParams(max_tokens=4, temperature=0.0),
    )
    return stub.Generate(req, timeout=30)


def test_a_slow_shared_step_fails_neither_the_long_prompt_nor_its_batch_mate(decode, paced):
    target, prefill = paced
    outs: dict[str, object] = {}

    def run(rid: str, n: int) -> None:
        try:
            outs[rid] = sum(len(m.token_ids) for m in generate(decode, target, rid, n))
        except grpc.RpcError as e:
            outs[rid] = e

    long = threading.Thread(target=run, args=("long-ok", LONG))
    long.start()
    time.sleep(FIRST_CHUNK_S + 0.2)  # the short request joins once the long one's first chunk arrived
    t0 = time.monotonic()
    run("short-ok", SHORT)
    long.join(30)
    assert outs == {"long-ok": 4, "short-ok": 4}, outs  # each waited STEP_S > page_timeout_s for its pages
    assert time.monotonic() - t0 > FLOOR_S
    wait_until(lambda: pool_empty(decode), what="decode pages freed")


def test_a_silent_prefill_still_fails_within_the_scaled_bound(decode, paced):
    target, prefill = paced
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(generate(decode, target, "long-stall", LONG))
    waited = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    assert "scaled to the work" in err.value.details() and "8 pages received" in err.value.details()
    assert waited < 10 + FIRST_CHUNK_S + 3  # the ceiling (page_timeout_max_s) and some slack for a loaded host
    assert prefill.ended.wait(10), "decode did not end the prefill stream"
    wait_until(lambda: pool_empty(decode), what="decode pages freed")
