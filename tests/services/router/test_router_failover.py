"""Transparent failover: a decode instance killed (SIGKILL) in the middle of a stream. The router resumes the
request on the other decode instance (prefill of prompt + the tokens already streamed) and the caller's stream
goes on: the same tokens, text, finish reason and usage as a run without the failure, greedy and seeded. And a
decode instance whose KV pool cannot take a request (RESOURCE_EXHAUSTED) makes the router try another pair.

The engines keep full-precision KV here (`--kv-dtype auto`): exactness is then down to the engine's prefill and
decode computing the same values. With int8 KV the resumed tokens' K/V are quantized from prefill's computation
instead of decode's, so a near-tie far down the stream may flip (seen once in 600 seeded tokens); the resume
itself (positions, sampling state, text) is the same."""

from __future__ import annotations

import random
import signal
import sys
import time
from pathlib import Path

import pytest

import pdserve
from pdserve.cli.launch import Stack, start_service, wait_ready
from pdserve.models.checkpoints import build_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from router_testutil import instances, listing, wait_states

pytestmark = pytest.mark.timeout(300)
ENGINE_FLAGS = [
    "--torch-threads",
    "1",
    "--page-size",
    "16",
    "--max-num-seqs",
    "8",
    "--num-pages",
    "512",
    "--kv-dtype",
    "auto",
]
MAX_TOKENS = 600


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One prefill, two decode instances (started first, on free ports), then one router over them (health checks
    every 0.5 s). `restart(addr)` starts a killed engine again on its port."""
    work = tmp_path_factory.mktemp("failover")
    model = build_checkpoint(work / "model", arch="llama", seed=4)
    common = ["--model", str(model), "--log-level", "INFO"]
    stack = Stack("", [], [])
    procs: dict = {}  # engine address -> its process

    def start(role: str, args: list[str]):
        started = start_service(role, [*common, *args], work)
        stack.procs.append(started[0])
        stack.logs.append(started[2])
        return started

    def restart(addr: str) -> None:
        started = start("decode", ["--port", addr.rsplit(":", 1)[1], *ENGINE_FLAGS])
        procs[addr] = started[0]
        wait_ready(*started, timeout=180)

    try:
        engines = [start(role, ENGINE_FLAGS) for role in ("prefill", "decode", "decode")]  # no --port: any free one
        P, D1, D2 = addrs = [wait_ready(*s, timeout=180) for s in engines]
        procs.update((a, s[0]) for a, s in zip(addrs, engines))
        args = ["--prefill", P, "--decode", D1, "--decode", D2, "--estimator-store", "memory"]
        router = wait_ready(*start("router", [*args, "--health-interval-s", "0.5"]), timeout=180)
        wait_states(router, {P: "up", D1: "up", D2: "up"})
    except BaseException:
        stack.stop()
        print(stack.log_text())
        raise
    yield dict(router=router, procs=procs, decode=[D1, D2], restart=restart, stack=stack)
    stack.stop()


@pytest.fixture(scope="module")
def small_pool_cluster(tmp_path_factory):
    """Round-robin router over a decode instance with a 4-page pool (64 tokens) and a normal one. The engines start
    first (free ports): the router's channels never see a closed port, so no request fails UNAVAILABLE on a
    channel still in reconnect backoff (a retry this test would count)."""
    work = tmp_path_factory.mktemp("small-pool")
    model = build_checkpoint(work / "model", arch="llama", seed=4)
    common = ["--model", str(model), "--log-level", "INFO"]
    stack = Stack("", [], [])

    def start(role: str, args: list[str]):
        started = start_service(role, [*common, *args], work)
        stack.procs.append(started[0])
        stack.logs.append(started[2])
        return started

    try:
        engines = [
            start("prefill", ENGINE_FLAGS),
            start("decode", [*ENGINE_FLAGS, "--num-pages", "4"]),
            start("decode", ENGINE_FLAGS),
        ]
        P, small, big = (wait_ready(*s, timeout=180) for s in engines)
        args = ["--prefill", P, "--decode", small, "--decode", big, "--policy", "round_robin"]
        router = wait_ready(
            *start("router", [*args, "--estimator-store", "memory", "--health-interval-s", "0.2"]), timeout=180
        )
        wait_states(router, {P: "up", small: "up", big: "up"})
    except BaseException:
        stack.stop()
        print(stack.log_text())
        raise
    yield dict(router=router, small=small, big=big)
    stack.stop()


def test_decode_out_of_pages_is_tried_on_another_pair(small_pool_cluster):
    r = small_pool_cluster["router"]
    with pdserve.Client(r, timeout=60) as c:
        outs = [c.generate(token_ids=prompt(10 + k, n=100), max_tokens=8, ignore_eos=True) for k in range(4)]
    assert all(len(o.token_ids) == 8 for o in outs)
    info = instances(r)
    assert listing(r).retries >= 1  # round robin sent some to the small pool first
    assert info[small_pool_cluster["small"]].state == "up"  # full is not broken: it stays in rotation
    assert info[small_pool_cluster["big"]].assigned >= 4


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 512) for _ in range(n)]


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
def test_decode_killed_mid_stream_is_invisible_to_the_caller(cluster, sampling):
    r = cluster["router"]
    kw = dict(token_ids=prompt(len(sampling)), max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    wait_states(r, {a: "up" for a in cluster["decode"]})
    with pdserve.Client(r, timeout=120) as c:
        ref = collect(c.stream(**kw))
        assert len(ref["tokens"]) == MAX_TOKENS
        retries = listing(r).retries
        stream = c.stream(**kw)
        head = []
        for chunk in stream:  # a few tokens, then kill the decode instance serving this request
            head.append(chunk)
            if sum(len(x.token_ids) for x in head) >= 10:
                break
        serving = [a for a, i in instances(r).items() if a in cluster["decode"] and i.in_flight]
        assert len(serving) == 1, instances(r)
        proc = cluster["procs"][serving[0]]
        proc.send_signal(signal.SIGKILL)
        killed_at = time.perf_counter()
        proc.wait(timeout=10)
        rest, arrivals = [], [killed_at]
        for chunk in stream:
            rest.append(chunk)
            arrivals.append(time.perf_counter())
        got = collect(head + rest)
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        print(
            f"{sampling}: longest gap between chunks after the kill {max(gaps) * 1e3:.0f} ms (the resume; "
            f"median gap {sorted(gaps)[len(gaps) // 2] * 1e3:.1f} ms)"
        )
    assert sum(len(x.token_ids) for x in head) < MAX_TOKENS  # the kill happened mid-stream
    assert got["tokens"] == ref["tokens"], len(got["tokens"])
    assert got["text"] == ref["text"]
    assert got["finish"] == ref["finish"] == "length"
    assert (got["usage"].prompt_tokens, got["usage"].completion_tokens) == (40, MAX_TOKENS)
    assert listing(r).retries == retries + 1
    assert instances(r)[serving[0]].state == "down"
    cluster["restart"](serving[0])  # same port: the router's health checks bring it back
