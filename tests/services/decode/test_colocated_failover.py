"""Transparent failover in colocated mode: the colocated instance serving a stream is killed (SIGKILL) mid-stream;
the router resumes the request on the other colocated instance (which re-prefills prompt + the tokens already
streamed) and the caller's stream goes on with the same tokens, text, finish reason and usage, greedy and seeded.
Full-precision KV (`--kv-dtype auto`), so exactness is down to the engine, as in test_router_failover.py."""

from __future__ import annotations

import random
import signal
import sys
from pathlib import Path

import pytest

import pdserve
from pdserve.cli.launch import Stack, start_service, wait_ready
from pdserve.models.checkpoints import build_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))
from router_testutil import instances, listing, wait_states

pytestmark = pytest.mark.timeout(300)
FLAGS = ["--torch-threads", "1", "--page-size", "16", "--max-num-seqs", "8", "--num-pages", "512", "--kv-dtype", "auto"]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("colocated-failover")
    model = build_checkpoint(work / "model", arch="llama", seed=4)
    stack = Stack("", [], [])
    procs: dict = {}

    def start(role: str, args: list[str]):
        started = start_service(role, ["--model", str(model), *args], work)  # inherits the tests' internal token
        stack.procs.append(started[0])
        stack.logs.append(started[2])
        return started

    def restart(addr: str) -> None:
        started = start("colocated", ["--port", addr.rsplit(":", 1)[1], *FLAGS])
        procs[addr] = started[0]
        wait_ready(*started, timeout=180)

    try:
        engines = [start("colocated", FLAGS) for _ in range(2)]
        addrs = [wait_ready(*s, timeout=180) for s in engines]
        procs.update((a, s[0]) for a, s in zip(addrs, engines))
        args = ["--colocated", addrs[0], "--colocated", addrs[1], "--estimator-store", "memory"]
        router = wait_ready(*start("router", [*args, "--health-interval-s", "0.5"]), timeout=180)
        wait_states(router, {a: "up" for a in addrs})
    except BaseException:
        stack.stop()
        print(stack.log_text())
        raise
    yield dict(router=router, procs=procs, colocated=addrs, restart=restart)
    stack.stop()


def collect(chunks) -> dict:
    out = {"tokens": [], "text": "", "finish": None, "usage": None}
    for c in chunks:
        out["tokens"] += c.token_ids
        out["text"] += c.text
        if c.finish_reason:
            out["finish"], out["usage"] = c.finish_reason, c.usage
    return out


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=5)], ids=["greedy", "seeded"]
)
def test_colocated_instance_killed_mid_stream_is_invisible_to_the_caller(cluster, sampling):
    r = cluster["router"]
    rng = random.Random(len(sampling))
    kw = dict(token_ids=[rng.randrange(5, 512) for _ in range(40)], max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    wait_states(r, {a: "up" for a in cluster["colocated"]})
    with pdserve.Client(r, timeout=120) as c:
        ref = collect(c.stream(**kw))
        assert len(ref["tokens"]) == MAX_TOKENS
        retries = listing(r).retries
        stream = c.stream(**kw)
        head = []
        for chunk in stream:  # a few tokens, then kill the instance serving this request
            head.append(chunk)
            if sum(len(x.token_ids) for x in head) >= 10:
                break
        serving = [a for a, i in instances(r).items() if i.in_flight]
        assert len(serving) == 1, instances(r)
        proc = cluster["procs"][serving[0]]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        got = collect(head + list(stream))
    assert sum(len(x.token_ids) for x in head) < MAX_TOKENS  # the kill happened mid-stream
    assert got["tokens"] == ref["tokens"], len(got["tokens"])
    assert got["text"] == ref["text"]
    assert got["finish"] == ref["finish"] == "length"
    assert (got["usage"].prompt_tokens, got["usage"].completion_tokens) == (40, MAX_TOKENS)
    assert listing(r).retries == retries + 1
    assert instances(r)[serving[0]].state == "down"
    cluster["restart"](serving[0])  # same port: the router's health checks bring it back
