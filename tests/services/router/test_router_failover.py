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
import sys
from functools import partial
from pathlib import Path

import pytest

import pdserve
from pdserve.models.checkpoints import build_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from router_testutil import ENGINE_FLAGS, instances, kill_mid_stream_is_invisible, listing, wait_states
from services_testutil import services

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 600


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One prefill, two decode instances (started first, on free ports), then one router over them (health checks
    every 0.5 s). `restart(addr)` starts a killed engine again on its port."""
    work = tmp_path_factory.mktemp("failover")
    model = build_checkpoint(work / "model", arch="llama", seed=4)
    with services(work, ["--model", str(model), "--log-level", "INFO"]) as group:
        P, D1, D2 = group.start([(role, ENGINE_FLAGS) for role in ("prefill", "decode", "decode")])
        args = ["--prefill", P, "--decode", D1, "--decode", D2, "--estimator-store", "memory"]
        (router,) = group.start([("router", [*args, "--health-interval-s", "0.5"])])
        wait_states(router, {P: "up", D1: "up", D2: "up"})
        restart = partial(group.restart, "decode", args=ENGINE_FLAGS)  # restart(addr)
        yield dict(router=router, procs=group.procs, decode=[D1, D2], restart=restart)


@pytest.fixture(scope="module")
def small_pool_cluster(tmp_path_factory):
    """Round-robin router over a decode instance with a 4-page pool (64 tokens) and a normal one. The engines start
    first (free ports): the router's channels never see a closed port, so no request fails UNAVAILABLE on a
    channel still in reconnect backoff (a retry this test would count)."""
    work = tmp_path_factory.mktemp("small-pool")
    model = build_checkpoint(work / "model", arch="llama", seed=4)
    with services(work, ["--model", str(model), "--log-level", "INFO"]) as group:
        P, small, big = group.start(
            [("prefill", ENGINE_FLAGS), ("decode", [*ENGINE_FLAGS, "--num-pages", "4"]), ("decode", ENGINE_FLAGS)]
        )
        args = ["--prefill", P, "--decode", small, "--decode", big, "--policy", "round_robin"]
        (router,) = group.start([("router", [*args, "--estimator-store", "memory", "--health-interval-s", "0.2"])])
        wait_states(router, {P: "up", small: "up", big: "up"})
        yield dict(router=router, small=small, big=big)


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


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=5)], ids=["greedy", "seeded"]
)
def test_decode_killed_mid_stream_is_invisible_to_the_caller(cluster, sampling):
    r = cluster["router"]
    kw = dict(token_ids=prompt(len(sampling)), max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    wait_states(r, {a: "up" for a in cluster["decode"]})
    killed, gaps = kill_mid_stream_is_invisible(r, kw, cluster["decode"], cluster["procs"])
    print(
        f"{sampling}: longest gap between chunks after the kill {max(gaps) * 1e3:.0f} ms (the resume; "
        f"median gap {sorted(gaps)[len(gaps) // 2] * 1e3:.1f} ms)"
    )
    cluster["restart"](killed)  # same port: the router's health checks bring it back
