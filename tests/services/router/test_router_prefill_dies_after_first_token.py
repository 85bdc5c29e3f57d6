"""A prefill instance that fails after the first token went out ahead of the KV pages (decode
--first-token-early): the caller already has that token, so the router resumes the request on another pair
(prompt + that token) and the caller's stream goes on with the same tokens as a run without the failure."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.prefill.servicer import add_prefill_servicer
from pdserve.server.grpc_util import channel
from pdserve.testing.impostors import serve
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent))
from router_testutil import wait_states
from services_testutil import services

pytestmark = pytest.mark.timeout(300)
FLAGS = ["--torch-threads", "1", "--page-size", "16", "--num-pages", "256", "--kv-dtype", "auto"]
MAX_TOKENS = 24


class DyingPrefill(internal_pb2_grpc.PrefillServicer):
    """Relays each Prefill stream to a real prefill instance up to its PrefillFirstToken (so the caller gets the
    true first token), then fails UNAVAILABLE before any KV batch: a prefill instance lost mid-transfer."""

    def __init__(self, target: str):
        self.channel = channel(target)  # with the stack's internal token
        self.stub = internal_pb2_grpc.PrefillStub(self.channel)
        self.first_tokens_relayed = 0

    def Prefill(self, request_iterator, context):
        first = next(request_iterator)
        assert first.request.first_token_early  # decode asks for it by default
        upstream = self.stub.Prefill(iter([first]), timeout=30)
        try:
            for msg in upstream:
                if msg.HasField("transport"):
                    yield msg
                elif msg.HasField("first_token"):
                    yield msg
                    self.first_tokens_relayed += 1
                    break
        finally:
            upstream.cancel()
        context.abort(grpc.StatusCode.UNAVAILABLE, "prefill instance lost mid-transfer (test)")

    def Stats(self, request, context):
        return self.stub.Stats(request, timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A real prefill P and the dying relay in front of it, two decode instances, a round-robin router over the
    two prefill addresses."""
    work = tmp_path_factory.mktemp("prefill-dies")
    model = build_checkpoint(work / "model", arch="llama", seed=5)
    with services(work, ["--model", str(model), "--log-level", "INFO"]) as group:
        P, D1, D2 = group.start([(role, FLAGS) for role in ("prefill", "decode", "decode")])
        dying = DyingPrefill(str(P))
        addr, server = serve(lambda s: add_prefill_servicer(dying, s))  # type: ignore[arg-type]  # Prefill, Stats
        try:
            args = ["--prefill", addr, "--prefill", P, "--decode", D1, "--decode", D2, "--policy", "round_robin"]
            (router,) = group.start([("router", [*args, "--estimator-store", "memory", "--health-interval-s", "0.5"])])
            wait_states(router, {addr: "up", P: "up", D1: "up", D2: "up"})
            yield dict(router=router, dying=dying, prefill=P, decode=D1)
        finally:
            server.stop(0)
            dying.channel.close()


def reference(cluster, ids: list[int]) -> list[int]:
    """The greedy tokens with no failure: decode D1 pulling from the real prefill directly."""
    req = internal_pb2.DecodeRequest(
        request_id=f"ref-{ids[0]}",
        prompt_token_ids=ids,
        prefill_target=str(cluster["prefill"]),
        sampling=generate_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    with channel(str(cluster["decode"])) as ch:
        return [t for m in internal_pb2_grpc.DecodeStub(ch).Generate(req, timeout=60) for t in m.token_ids]


def test_the_stream_goes_on_after_a_prefill_lost_past_the_first_token(cluster):
    prompts = [[7 + (11 * i + 5 * j) % 300 for i in range(37 + j)] for j in range(4)]
    with pdserve.Client(cluster["router"], timeout=60) as c:
        for ids in prompts:
            got, usage = [], None
            for ch in c.stream(token_ids=ids, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True):
                got += ch.token_ids
                usage = ch.usage or usage
            assert got == reference(cluster, ids)
            assert usage is not None and usage.completion_tokens == MAX_TOKENS
    # round robin over two prefill addresses: about half the requests met the dying one after their first token
    assert cluster["dying"].first_tokens_relayed >= 1
