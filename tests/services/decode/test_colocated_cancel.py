"""A caller that cancels during a long prompt's prefill stops its remaining chunks at once (issue 35 item 4): a
colocated instance (a process) prefilling a 1,000-token prompt in chunks of 2 aborts the request from gRPC's
callback, so its pages are free long before the prefill would have ended, not only when the stream's reader next
looks (once a second while no output is due)."""

from __future__ import annotations

import time

import pytest
from services_testutil import pool_empty, prompts, running_service

from pdserve.server.grpc_util import channel
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

PROMPT, CHUNK = 1000, 2  # 500 prefill steps


@pytest.fixture(scope="module")
def colocated(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("colocated-cancel")
    args = ["--model", str(model_dir), "--page-size", "4", "--chunk-size", str(CHUNK), "--num-pages", "600"]
    args += ["--kv-dtype", "auto", "--torch-threads", "1"]
    with running_service("colocated", args, work) as addr, channel(addr) as ch:
        yield internal_pb2_grpc.DecodeStub(ch)


def generate(stub, rid: str, seed: int):
    req = internal_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompts(PROMPT, seed=seed),
        sampling=generate_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    )
    return stub.Generate(req, timeout=120)


def test_a_cancelled_long_prefill_stops_at_once(colocated):
    t0 = time.monotonic()
    assert sum(len(m.token_ids) for m in generate(colocated, "whole", seed=31)) == 2
    whole_s = time.monotonic() - t0  # the prefill alone, as the cancelled request would have run it
    call = generate(colocated, "cancelled", seed=32)  # another prompt: nothing of it cached
    wait_until(lambda: not pool_empty(colocated), what="the prefill started")
    call.cancel()
    t_cancel = time.monotonic()
    wait_until(lambda: pool_empty(colocated), timeout=60, what="the cancelled request's pages freed")
    freed_s = time.monotonic() - t_cancel
    # its remaining chunks did not run: freed within a step or two, not at the reader's next 1 s poll (or later)
    assert freed_s < min(0.75, whole_s / 2), (freed_s, whole_s)
