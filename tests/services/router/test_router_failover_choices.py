"""Transparent failover of n > 1: the instance streaming a request's three choices is killed (SIGKILL) mid-stream
(a decode instance of a prefill/decode pair, and a colocated instance); the router resumes each unfinished choice on
the other instance (prompt + that choice's tokens, its own generator) and the caller's stream goes on: every choice
complete, each ending once, the same tokens and text as a run without the failure (greedy and seeded), the
request's usage on the last chunk. And best_of's usage counts every candidate's tokens, through gRPC and the OpenAI
gateway. Real processes; full-precision KV, as test_router_failover.py says why."""

from __future__ import annotations

import random
import re
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import openai
import pytest

import pdserve
from pdserve.cli.launch import start_service, wait_ready
from pdserve.models.checkpoints import build_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from router_testutil import ENGINE_FLAGS, instances, listing, wait_states
from services_testutil import services

pytestmark = pytest.mark.timeout(400)
N = 3
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One prefill, two decode instances, a router over them (health checks every 0.5 s) and a gateway in front."""
    work = tmp_path_factory.mktemp("failover-choices")
    model = build_checkpoint(work / "model", arch="llama", seed=4)
    with services(work, ["--model", str(model), "--log-level", "INFO"]) as group:
        P, D1, D2 = group.start([(role, ENGINE_FLAGS) for role in ("prefill", "decode", "decode")])
        args = ["--prefill", P, "--decode", D1, "--decode", D2, "--estimator-store", "memory"]
        (router,) = group.start([("router", [*args, "--health-interval-s", "0.5"])])
        wait_states(router, {P: "up", D1: "up", D2: "up"})
        proc, ready, log = start_service("gateway", ["--router", str(router)], work)
        group.stack.procs.append(proc)
        gateway = wait_ready(proc, ready, log, timeout=60)
        restart = partial(group.restart, "decode", args=ENGINE_FLAGS)  # restart(addr)
        yield dict(router=router, gateway=gateway, procs=group.procs, decode=[D1, D2], restart=restart)


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 512) for _ in range(n)]


def by_choice(chunks) -> dict[int, dict]:
    """Each choice's tokens, text and finish reasons (one per chunk that ended it)."""
    out: dict[int, dict] = {}
    for c in chunks:
        choice = out.setdefault(c.index, {"tokens": [], "text": "", "finishes": []})
        choice["tokens"] += c.token_ids
        choice["text"] += c.text
        if c.finish_reason is not None:
            choice["finishes"].append(c.finish_reason)
    return out


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """Two colocated instances (each prefills and decodes) under a router."""
    work = tmp_path_factory.mktemp("failover-choices-colocated")
    model = build_checkpoint(work / "model", arch="llama", seed=4)
    with services(work, ["--model", str(model)]) as group:
        addrs = group.start([("colocated", ENGINE_FLAGS)] * 2)
        args = ["--colocated", addrs[0], "--colocated", addrs[1], "--estimator-store", "memory"]
        (router,) = group.start([("router", [*args, "--health-interval-s", "0.5"])])
        wait_states(router, {a: "up" for a in addrs})
        restart = partial(group.restart, "colocated", args=ENGINE_FLAGS)
        yield dict(router=router, procs=group.procs, decode=addrs, restart=restart)


SAMPLINGS = [dict(temperature=0.0), dict(temperature=0.9, top_k=40, seed=5)]
LETTERS = "[a-z]{1000}"  # longer than MAX_TOKENS tokens can spell: every token of every choice is constrained


@pytest.mark.parametrize(
    "sampling", [*SAMPLINGS, dict(SAMPLINGS[1], regex=LETTERS)], ids=["greedy", "seeded", "seeded-regex"]
)
def test_decode_killed_mid_stream_every_choice_completes(cluster, sampling):
    """With a regex, each resumed choice's grammar state is its tokens replayed (a wrong one: INVALID_ARGUMENT)."""
    got = kill_mid_stream_every_choice_completes(cluster, sampling)
    if "regex" in sampling:
        assert all(re.fullmatch("[a-z]+", ch["text"]) for ch in got.values())


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_colocated_killed_mid_stream_every_choice_completes(colocated, sampling):
    kill_mid_stream_every_choice_completes(colocated, sampling)


def kill_mid_stream_every_choice_completes(cluster: dict, sampling: dict) -> dict[int, dict]:
    """Stream n = 3 once whole, then again, SIGKILLing the engine serving it after about ten tokens of each choice:
    every choice the same, each ended once, the request's usage on the last chunk; one retry, the engine down
    (then restarted). Returns the choices got."""
    r = cluster["router"]
    ids = prompt(len(sampling))
    kw = dict(token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True, n=N, **sampling)
    wait_states(r, {a: "up" for a in cluster["decode"]})
    with pdserve.Client(r, timeout=120) as c:
        ref = by_choice(c.stream(**kw))
        assert sorted(ref) == list(range(N))
        assert all(len(ch["tokens"]) == MAX_TOKENS and ch["finishes"] == ["length"] for ch in ref.values())
        distinct = len({tuple(ch["tokens"]) for ch in ref.values()})
        assert distinct == (1 if sampling["temperature"] == 0 else N)  # greedy: alike; seeded: each its generator
        retries = listing(r).retries
        stream = c.stream(**kw)
        head = []
        for chunk in stream:
            head.append(chunk)
            if sum(len(x.token_ids) for x in head) >= 10 * N:
                break
        serving = [a for a, i in instances(r).items() if a in cluster["decode"] and i.in_flight]
        assert len(serving) == 1, instances(r)
        proc = cluster["procs"][serving[0]]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        rest = list(stream)
    assert sum(len(x.token_ids) for x in head) < N * MAX_TOKENS  # the kill happened mid-stream
    got = by_choice(head + rest)
    for i in range(N):
        assert got[i]["tokens"] == ref[i]["tokens"], (i, len(got[i]["tokens"]))  # nothing lost, nothing twice
        assert got[i]["text"] == ref[i]["text"]
        assert got[i]["finishes"] == ["length"]  # each choice ends once
    finishing = [x for x in head + rest if x.finish_reason is not None]
    assert finishing[-1] is (head + rest)[-1]
    last = finishing[-1].usage
    assert (last.prompt_tokens, last.completion_tokens) == (len(ids), N * MAX_TOKENS)  # the request's usage
    assert all(x.usage.completion_tokens == 0 for x in finishing[:-1])  # the other choices' ends carry none
    assert listing(r).retries == retries + 1
    assert instances(r)[serving[0]].state == "down"
    cluster["restart"](serving[0])  # same port: the router's health checks bring it back
    wait_states(r, {a: "up" for a in cluster["decode"]})
    return got


def test_best_of_survives_its_decode_instance_killed(cluster):
    """best_of > n (Generate): the candidates' outputs come at the end, so a decode instance killed while they run
    is a retry from scratch on the other one; seeded, the caller gets what an unfailed run gives."""
    r = cluster["router"]
    kw = dict(token_ids=prompt(11), max_tokens=400, ignore_eos=True, temperature=0.9, seed=8, n=2, best_of=3)
    wait_states(r, {a: "up" for a in cluster["decode"]})
    with pdserve.Client(r, timeout=120) as c:
        ref = c.generate(**kw)
        retries = listing(r).retries
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(c.generate, **kw)
            deadline = time.monotonic() + 30
            while not (serving := [a for a, i in instances(r).items() if a in cluster["decode"] and i.in_flight]):
                assert time.monotonic() < deadline, "the request never reached a decode instance"
                time.sleep(0.01)
            time.sleep(0.3)  # its candidates are decoding
            assert not fut.done()
            proc = cluster["procs"][serving[0]]
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            got = fut.result(timeout=120)
    assert [ch.token_ids for ch in got.choices] == [ch.token_ids for ch in ref.choices]
    assert got.usage.completion_tokens == ref.usage.completion_tokens == 3 * 400  # every candidate, once
    assert listing(r).retries == retries + 1
    cluster["restart"](serving[0])
    wait_states(r, {a: "up" for a in cluster["decode"]})


def test_best_of_usage_counts_every_candidate(cluster):
    """OpenAI bills best_of's candidates: usage.completion_tokens is best_of x the tokens each ran (ignore_eos, so
    every candidate runs max_tokens); each returned choice's own usage is its own."""
    r = cluster["router"]
    ids = prompt(7, n=7)
    kw = dict(token_ids=ids, max_tokens=6, ignore_eos=True, temperature=1.0, seed=3)
    wait_states(r, {a: "up" for a in cluster["decode"]})
    with pdserve.Client(r, timeout=120) as c:
        one = c.generate(**kw, best_of=3)
        assert len(one.token_ids) == 6 and (one.usage.prompt_tokens, one.usage.completion_tokens) == (7, 18)
        two = c.generate(**kw, n=2, best_of=4)
        assert [ch.usage.completion_tokens for ch in two.choices] == [6, 6]
        assert two.usage.completion_tokens == 24
        plain = c.generate(**kw, n=2)
        assert plain.usage.completion_tokens == 12  # best_of = n: the choices' tokens, nothing more
    oai = openai.OpenAI(base_url=f"http://{cluster['gateway']}/v1", api_key="none", max_retries=0, timeout=60)
    model = oai.models.list().data[0].id
    out = oai.completions.create(
        model=model,
        prompt=ids,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        n=1,
        best_of=3,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 1
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (7, 18, 25)
