"""Transparent failover in colocated mode: the colocated instance serving a stream is killed (SIGKILL) mid-stream;
the router resumes the request on the other colocated instance (which re-prefills prompt + the tokens already
streamed) and the caller's stream goes on with the same tokens, text, finish reason and usage, greedy and seeded.
Full-precision KV (`--kv-dtype auto`), so exactness is down to the engine, as in test_router_failover.py."""

from __future__ import annotations

import random
import sys
from functools import partial
from pathlib import Path

import pytest

from pdserve.models.checkpoints import build_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))
from router_testutil import kill_mid_stream_is_invisible, wait_states
from services_testutil import services

pytestmark = pytest.mark.timeout(300)
FLAGS = ["--torch-threads", "1", "--page-size", "16", "--max-num-seqs", "8", "--num-pages", "512", "--kv-dtype", "auto"]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("colocated-failover")
    model = build_checkpoint(work / "model", arch="llama", seed=4)
    with services(work, ["--model", str(model)]) as group:  # inherits the tests' internal token
        addrs = group.start([("colocated", FLAGS)] * 2)
        args = ["--colocated", addrs[0], "--colocated", addrs[1], "--estimator-store", "memory"]
        (router,) = group.start([("router", [*args, "--health-interval-s", "0.5"])])
        wait_states(router, {a: "up" for a in addrs})
        restart = partial(group.restart, "colocated", args=FLAGS)  # restart(addr)
        yield dict(router=router, procs=group.procs, colocated=addrs, restart=restart)


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=5)], ids=["greedy", "seeded"]
)
def test_colocated_instance_killed_mid_stream_is_invisible_to_the_caller(cluster, sampling):
    r = cluster["router"]
    rng = random.Random(len(sampling))
    kw = dict(token_ids=[rng.randrange(5, 512) for _ in range(40)], max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    wait_states(r, {a: "up" for a in cluster["colocated"]})
    killed, _ = kill_mid_stream_is_invisible(r, kw, cluster["colocated"], cluster["procs"])
    cluster["restart"](killed)  # same port: the router's health checks bring it back
