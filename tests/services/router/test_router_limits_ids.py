"""The router's trust boundary over real processes (router, one prefill, two decodes): request limits (set by flag
to small values, so the flags are what is tested) and malformed input answered INVALID_ARGUMENT at once, and a
caller's request_id that is only a label: a second request reusing one in flight runs beside the first, both
correct, on other decode instances."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from services_testutil import tiny_stack

from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, generate_pb2_grpc, internal_pb2, internal_pb2_grpc

LIMITS = {
    "--max-prompt-bytes": 65536,
    "--max-messages": 4,
    "--max-stop": 3,
    "--max-stop-chars": 32,
    "--max-stop-token-ids": 8,
    "--max-request-id-bytes": 64,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("router-limits")
    model = build_checkpoint(work / "ckpt", arch="llama", seed=3)
    flags = [str(x) for kv in LIMITS.items() for x in kv]
    with tiny_stack(
        model, work / "stack", kv_dtype="auto", num_decode=2, router_extra=[*flags, "--log-level", "INFO"]
    ) as s:
        with channel(s.router) as ch:
            yield s, ch


def stub(stack) -> generate_pb2_grpc.GenerationStub:
    return generate_pb2_grpc.GenerationStub(stack[1])


def refused(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        out = call(*args, **kw)
        if not isinstance(out, generate_pb2.GenerateResponse):
            list(out)
    return err.value


def greedy(max_tokens: int = 4, **kw) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


@pytest.mark.parametrize(
    "request_kw, reason",
    [
        ({"prompt": "x" * 65537}, "max_prompt_bytes=65536"),
        ({"prompt": "é" * 32769}, "max_prompt_bytes=65536"),  # 32769 characters, 65538 bytes
        ({"messages": [generate_pb2.ChatMessage(role="user", content="hi")] * 5}, "max_messages=4"),
        ({"messages": [generate_pb2.ChatMessage(role="user", content="y" * 65536)]}, "max_prompt_bytes"),
        ({"prompt": "hi", "sampling": greedy(stop=["a", "b", "c", "d"])}, "max_stop=3"),
        ({"prompt": "hi", "sampling": greedy(stop=["s" * 33])}, "max_stop_chars=32"),
        ({"prompt": "hi", "sampling": greedy(stop_token_ids=list(range(9)))}, "max_stop_token_ids=8"),
        ({"prompt": "hi", "request_id": "r" * 65}, "max_request_id_bytes=64"),
        ({"prompt": "hi", "priority": 7}, "priority 7"),  # proto3 keeps an unknown enum number
        ({"token_ids": generate_pb2.TokenIds(ids=[5] * 5000)}, "model context"),
    ],
)
@pytest.mark.parametrize("streaming", [True, False])
def test_over_a_limit_is_invalid_argument(stack, request_kw, reason, streaming):
    s = stub(stack)
    err = refused(s.GenerateStream if streaming else s.Generate, generate_pb2.GenerateRequest(**request_kw), timeout=30)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert reason in err.details(), err.details()


def test_at_the_limits_is_served(stack):
    msgs = [generate_pb2.ChatMessage(role="user", content="hi")] * 4
    for kw in (
        {"prompt": "hi", "sampling": greedy(stop=["a" * 32, "b", "c"], stop_token_ids=list(range(1, 9)))},
        {"prompt": "hi", "request_id": "r" * 64},
        {"messages": msgs, "sampling": greedy()},
    ):
        out = stub(stack).Generate(generate_pb2.GenerateRequest(**kw), timeout=60)
        assert out.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
    out = stub(stack).Generate(generate_pb2.GenerateRequest(prompt="hi", request_id="r" * 64), timeout=60)
    assert out.request_id == "r" * 64  # the caller's label comes back


def test_huge_inputs_are_refused_in_milliseconds(stack, capsys):
    """3 MB and 10 MB prompts, 100k stop strings: refused at once (the port's message limit, RESOURCE_EXHAUSTED, or
    the router's own limits), never tokenized or handed to a decode thread."""
    s = stub(stack)
    cases = {
        "prompt 3 MB": generate_pb2.GenerateRequest(prompt="lorem ipsum " * 262_144),  # under the message limit
        "prompt 10 MB": generate_pb2.GenerateRequest(prompt="lorem ipsum " * 873_814),
        "100k stop strings": generate_pb2.GenerateRequest(prompt="hi", sampling=greedy(stop=["zz"] * 100_000)),
    }
    for name, req in cases.items():
        t0 = time.perf_counter()
        err = refused(s.Generate, req, timeout=30)
        ms = (time.perf_counter() - t0) * 1e3
        assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), err
        with capsys.disabled():
            print(f"\n{name} ({req.ByteSize() / 1e6:.1f} MB): {err.code().name} after {ms:.1f} ms")


def test_invalid_utf8_is_invalid_argument(stack):
    bad = b"\x12\x03a\xff\xfe"  # field 2 (prompt), 3 bytes, not UTF-8
    ch = stack[1]
    unary = ch.unary_unary(
        "/pdserve.v1.Generation/Generate", response_deserializer=generate_pb2.GenerateResponse.FromString
    )
    streaming = ch.unary_stream(
        "/pdserve.v1.Generation/GenerateStream", response_deserializer=generate_pb2.GenerateStreamResponse.FromString
    )
    for call in (unary, streaming):
        err = refused(call, bad, timeout=10)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.details(), err


def router_log(stack) -> str:
    return next(p for p in stack[0].logs if p.name.startswith("router")).read_text()


def test_reused_request_id_in_flight_runs_beside_the_first(stack, capsys):
    """The original defect: with two decode instances, a second request carrying the id of one still in prefill
    failed ALREADY_EXISTS and freed the first one's prefill, which then hung until its deadline. Now the caller's
    id is a label: both run (on different decode instances), both give the same greedy completion, promptly."""
    s, st = stub(stack), stack[0]
    req = generate_pb2.GenerateRequest(
        request_id="same",
        token_ids=generate_pb2.TokenIds(ids=[5 + (i * 13) % 400 for i in range(1000)]),  # 125 prefill chunks
        sampling=greedy(max_tokens=8, ignore_eos=True),
    )
    prefill = internal_pb2_grpc.PrefillStub(channel(st.prefill[0]))

    def run() -> tuple[list[generate_pb2.GenerateStreamResponse], float]:
        t0 = time.perf_counter()
        chunks = list(s.GenerateStream(req, timeout=20))  # page/ack timeouts are 30 s: a hang fails here
        return chunks, time.perf_counter() - t0

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(run)
        wait_until(
            lambda: prefill.Stats(internal_pb2.StatsRequest(), timeout=5).active_requests >= 1 or first.done(),
            what="the first request in prefill",
        )
        assert not first.done(), "the first request finished before the second could overlap it"
        second = pool.submit(run)
        (a, a_s), (b, b_s) = first.result(), second.result()
    tokens = [[t for c in chunks for t in c.token_ids] for chunks in (a, b)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8
    for chunks in (a, b):
        assert {c.request_id for c in chunks} == {"same"}
        assert chunks[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    lines = wait_until(
        lambda: len(found := re.findall(r"label='same'.* decode=(\S+)", router_log(stack))) == 2 and found
    )
    assert set(lines) == set(st.decode), lines  # one on each decode instance: the case that used to hang
    with capsys.disabled():
        print(f"\nreused id in flight: first {a_s * 1e3:.0f} ms, second {b_s * 1e3:.0f} ms")
