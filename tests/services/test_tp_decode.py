"""Tensor parallel decode instances through the real services (issue 31 stage 2): a TP=1 prefill ships pages of
every KV head; decode instances at `--tensor-parallel-size` 2 and 3 (6 query heads over 2 KV heads: a plain split
and copies) import them, each rank keeping its own heads, behind a router.

- fp32, full-precision KV: greedy tokens through the stack equal HF's (so TP=1's, test_e2e).
- A follower rank of the decode instance serving a stream is SIGKILLed mid-stream: the instance exits non-zero, no
  process of it survives, the caller's stream completes through the router's failover with the same tokens.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import psutil
import pytest
from services_testutil import prompts, services

import pdserve
from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.hf_reference import hf_greedy, load_hf_model

sys.path.insert(0, str(Path(__file__).parent / "router"))
from router_testutil import collect, instances, listing, wait_states

pytestmark = pytest.mark.timeout(400)
FLAGS = ["--torch-threads", "1", "--page-size", "4", "--chunk-size", "8", "--num-pages", "256", "--kv-dtype", "auto"]
TP_SIZES = (2, 3)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    shape = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96)
    return build_checkpoint(tmp_path_factory.mktemp("tp-decode-model") / "ckpt", arch="llama", seed=5, **shape)


@pytest.fixture(scope="module")
def stack(tp_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("tp-decode")
    with services(work, ["--model", str(tp_model)]) as group:
        specs = [("prefill", FLAGS)] + [("decode", [*FLAGS, "--tensor-parallel-size", str(n)]) for n in TP_SIZES]
        prefill, *decode = group.start(specs)
        args = ["--prefill", prefill, *[f for a in decode for f in ("--decode", a)]]
        (router,) = group.start([("router", [*args, "--estimator-store", "memory", "--health-interval-s", "0.5"])])
        wait_states(router, {a: "up" for a in [prefill, *decode]})
        yield dict(router=router, decode=decode, procs=group.procs)


def test_tp_decode_token_identical_to_hf(stack, tp_model):
    hf = load_hf_model(tp_model)
    served = set()
    with pdserve.Client(stack["router"], timeout=120) as c:
        for n in (1, 4, 5, 17, 30):  # a page, page edges, several chunks
            ids = prompts(n, seed=8)
            before = {a: i.assigned for a, i in instances(stack["router"]).items() if a in stack["decode"]}
            out = c.generate(token_ids=ids, max_tokens=10, temperature=0, ignore_eos=True)
            assert out.token_ids == hf_greedy(hf, ids, 10), f"prompt length {n}"
            after = instances(stack["router"])
            served |= {a for a in stack["decode"] if after[a].assigned > before[a]}
    assert served, "no decode instance served a request"


def test_killing_a_decode_follower_rank_mid_stream_fails_over(stack):
    router, engines = stack["router"], stack["decode"]
    kw = dict(token_ids=prompts(12, seed=9), max_tokens=150, ignore_eos=True, temperature=0.0)
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
        rank0 = stack["procs"][serving[0]]
        ranks = psutil.Process(rank0.pid).children()
        assert len(ranks) == TP_SIZES[engines.index(serving[0])] - 1
        ranks[0].send_signal(signal.SIGKILL)
        rest = list(stream)
    got = collect(head + rest)
    assert sum(len(x.token_ids) for x in head) < kw["max_tokens"]
    assert got["tokens"] == ref["tokens"] and got["finish"] == "length"
    assert listing(router).retries == retries + 1
    assert rank0.wait(timeout=30) != 0
    _, left = psutil.wait_procs(ranks, timeout=15)
    assert not left, f"ranks {[p.pid for p in left]} outlived their instance"
