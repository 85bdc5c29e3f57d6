"""Tensor parallel through the real services (issue 31 stage 2): two colocated instances of a 6-head model
(`--tensor-parallel-size` 2 and 3: each instance process is rank 0 and starts the other ranks) behind a router.

- fp32, full-precision KV: each instance's greedy tokens equal HF's (which the TP=1 engine equals, test_e2e), so
  TP=2 and TP=3 are token-identical to TP=1; /metrics reports the TP size.
- A follower rank of the instance serving a stream is SIGKILLed mid-stream: the instance exits non-zero, no
  process of it survives, and the caller's stream completes through the router's failover to the other instance
  with the uninterrupted stream's tokens.
"""

from __future__ import annotations

import signal
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from services_testutil import prompts, services

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.server.grpc_util import channel
from pdserve.testing.hf_reference import hf_greedy, load_hf_model
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc

sys.path.insert(0, str(Path(__file__).parent / "router"))
from router_testutil import collect, instances, listing, wait_states

pytestmark = pytest.mark.timeout(400)
FLAGS = ["--torch-threads", "1", "--page-size", "4", "--chunk-size", "8", "--num-pages", "256", "--kv-dtype", "auto"]
TP_SIZES = (2, 3)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    """6 query heads over 2 KV heads: TP=2 splits the KV heads, TP=3 holds copies ([0,0], [0,1], [1,1])."""
    shape = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96)
    return build_checkpoint(tmp_path_factory.mktemp("tp-model") / "ckpt", arch="llama", seed=2, **shape)


@pytest.fixture(scope="module")
def cluster(tp_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("tp-colocated")
    with services(work, ["--model", str(tp_model)]) as group:
        addrs = group.start([("colocated", [*FLAGS, "--tensor-parallel-size", str(n)]) for n in TP_SIZES])
        args = [f for a in addrs for f in ("--colocated", a)]
        (router,) = group.start([("router", [*args, "--estimator-store", "memory", "--health-interval-s", "0.5"])])
        wait_states(router, {a: "up" for a in addrs})
        yield dict(router=router, colocated=addrs, procs=group.procs)


def generate(addr: str, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of one request sent to an instance directly (no router)."""
    req = internal_pb2.DecodeRequest(
        request_id=f"tp-{time.monotonic_ns()}",
        prompt_token_ids=ids,
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    with channel(addr) as ch:
        return [t for m in internal_pb2_grpc.DecodeStub(ch).Generate(req, timeout=120) for t in m.token_ids]


def test_tp_instances_token_identical_to_hf(cluster, tp_model):
    hf = load_hf_model(tp_model)
    for n in (1, 5, 17):  # within a page, across pages, across chunks
        ids = prompts(n, seed=5)
        want = hf_greedy(hf, ids, 10)
        for size, addr in zip(TP_SIZES, cluster["colocated"]):
            assert generate(addr, ids, 10) == want, f"TP={size}, prompt length {n}"
    with pdserve.Client(cluster["router"], timeout=120) as c:
        ids = prompts(9, seed=6)
        assert c.generate(token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True).token_ids == hf_greedy(
            hf, ids, 8
        )


def test_metrics_report_the_tp_size(cluster):
    for size, addr in zip(TP_SIZES, cluster["colocated"]):
        text = urllib.request.urlopen(f"http://{addr.metrics}/metrics", timeout=10).read().decode()
        assert f"pdserve_tensor_parallel_size {float(size)}" in text


def test_killing_a_follower_rank_mid_stream_fails_over(cluster):
    router, engines = cluster["router"], cluster["colocated"]
    kw = dict(token_ids=prompts(12, seed=7), max_tokens=150, ignore_eos=True, temperature=0.0)
    with pdserve.Client(router, timeout=120) as c:
        ref = collect(c.stream(**kw))
        retries = listing(router).retries
        stream = c.stream(**kw)
        head = []
        for chunk in stream:
            head.append(chunk)
            if sum(len(x.token_ids) for x in head) >= 8:
                break
        serving = [a for a, i in instances(router).items() if a in engines and i.in_flight]
        assert len(serving) == 1, instances(router)
        rank0 = cluster["procs"][serving[0]]
        ranks = psutil.Process(rank0.pid).children()  # the followers: ranks 1..N-1
        assert len(ranks) == TP_SIZES[engines.index(serving[0])] - 1
        ranks[-1].send_signal(signal.SIGKILL)
        rest = list(stream)
    got = collect(head + rest)
    assert sum(len(x.token_ids) for x in head) < kw["max_tokens"]  # the kill happened mid-stream
    assert got["tokens"] == ref["tokens"] and got["finish"] == "length"
    assert listing(router).retries == retries + 1
    assert rank0.wait(timeout=30) != 0  # the instance ended itself, non-zero
    gone = lambda p: not p.is_running() or p.status() == psutil.STATUS_ZOMBIE  # noqa: E731
    deadline = time.monotonic() + 15
    while not all(gone(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in ranks), "a rank of the dead instance survived"


def test_killing_rank0_takes_its_followers_down(cluster):
    """Whichever instance is still up: SIGKILL its rank 0 (the service process); its followers end with it."""
    alive = [a for a in cluster["colocated"] if cluster["procs"][a].poll() is None]
    assert alive, "no instance left to kill"
    rank0 = cluster["procs"][alive[0]]
    ranks = psutil.Process(rank0.pid).children()
    assert len(ranks) == TP_SIZES[cluster["colocated"].index(alive[0])] - 1
    rank0.send_signal(signal.SIGKILL)
    rank0.wait(timeout=10)
    _, left = psutil.wait_procs(ranks, timeout=15)
    assert not left, f"ranks {[p.pid for p in left]} outlived their instance"
