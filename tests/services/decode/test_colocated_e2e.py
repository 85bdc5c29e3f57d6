"""Colocated mode end to end: router + colocated instances (`pdserve serve colocated`) as real processes over gRPC.
Greedy output token-identical to the HF reference with full-precision KV (sequential and concurrent, so prefill
chunks interleave with decode steps), int8 KV measured against the disaggregated int8 stack, the prompt cache,
the router's view (role, Stats), and bad input."""

from __future__ import annotations

import concurrent.futures as cf
import sys
from pathlib import Path

import grpc
import pytest
from services_testutil import greedy_agreement, prompts, stack_pools_empty, tiny_stack

import pdserve
from pdserve.server.grpc_util import channel
from pdserve.testing.hf_reference import hf_greedy
from pdserve.testing.wait import wait_until
from pdserve.v1 import generate_pb2, internal_pb2, internal_pb2_grpc
from pdserve.v1 import router_admin_pb2 as pb

sys.path.insert(0, str(Path(__file__).parents[1] / "router"))
from router_testutil import instances

pytestmark = pytest.mark.timeout(600)
PAGE, CHUNK = 4, 8
LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]


@pytest.fixture(scope="module")
def auto_stack(model_dir, tmp_path_factory):
    """Router + one colocated instance, full-precision KV, prompt cache in-process (the default)."""
    work = tmp_path_factory.mktemp("colocated-auto")
    with tiny_stack(model_dir, work, kv_dtype="auto", page_size=PAGE, chunk_size=CHUNK, num_colocated=1) as stack:
        yield stack


def stats(addr: str) -> internal_pb2.InstanceStats:
    with channel(addr) as ch:
        return internal_pb2_grpc.DecodeStub(ch).Stats(internal_pb2.StatsRequest(), timeout=5)


def test_auto_kv_token_identical_to_hf(auto_stack, hf_model):
    assert auto_stack.colocated and not auto_stack.prefill and not auto_stack.decode
    with pdserve.Client(auto_stack.router, timeout=120) as c:
        for n in LENGTHS:
            ids = prompts(n)
            out = c.generate(token_ids=ids, max_tokens=12, temperature=0, ignore_eos=True)
            assert out.token_ids == hf_greedy(hf_model, ids, 12), f"prompt length {n}"
            assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 12
    wait_until(lambda: stack_pools_empty(auto_stack), timeout=10, what="colocated KV pool empty")


def test_n_choices_fork_after_one_prefill(auto_stack, hf_model):
    """n = 4 greedy: four identical completions equal to HF's (the prompt computed once, forked); n = 3 seeded:
    reproducible, and streamed as generated."""
    ids = prompts(PAGE + 1, seed=7)
    with pdserve.Client(auto_stack.router, timeout=120) as c:
        four = c.generate(token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True, n=4)
        assert [ch.token_ids for ch in four.choices] == [hf_greedy(hf_model, ids, 8)] * 4
        assert (four.usage.prompt_tokens, four.usage.completion_tokens) == (PAGE + 1, 32)
        kw = dict(token_ids=ids, max_tokens=8, temperature=1.0, seed=4, ignore_eos=True, n=3)
        three = [ch.token_ids for ch in c.generate(**kw).choices]
        assert three == [ch.token_ids for ch in c.generate(**kw).choices] and len({tuple(t) for t in three}) > 1
        streamed: dict[int, list[int]] = {}
        for chunk in c.stream(**kw):
            streamed.setdefault(chunk.index, []).extend(chunk.token_ids)
        assert streamed == dict(enumerate(three))
    wait_until(lambda: stack_pools_empty(auto_stack), timeout=10, what="colocated KV pool empty")


def test_concurrent_requests_interleave_prefill_chunks_with_decode(auto_stack, hf_model):
    """Long prompts (several chunks) arrive while others decode: every stream is still exactly HF's."""
    reqs = [prompts(n, seed=5) for n in (40, 3, 29, 17, 2, 33)]

    def run(ids):
        with pdserve.Client(auto_stack.router, timeout=120) as c:
            return c.generate(token_ids=ids, max_tokens=10, temperature=0, ignore_eos=True).token_ids

    with cf.ThreadPoolExecutor(len(reqs)) as ex:
        got = list(ex.map(run, reqs))
    for ids, toks in zip(reqs, got):
        assert toks == hf_greedy(hf_model, ids, 10), len(ids)
    wait_until(lambda: stack_pools_empty(auto_stack), timeout=10, what="colocated KV pool empty")


def test_prompt_cache_serves_the_prefix_and_output_is_unchanged(auto_stack):
    ids = prompts(6 * PAGE + 3, seed=9)
    with pdserve.Client(auto_stack.router, timeout=120) as c:
        first = c.generate(token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True)
        # the write-back is asynchronous: wait until the second request finds the pages
        seen = []

        def cached() -> bool:
            out = c.generate(token_ids=ids, max_tokens=8, temperature=0, ignore_eos=True)
            seen.append(out)
            return out.usage.cached_tokens > 0

        wait_until(cached, timeout=20, what="a prompt cache hit")
    assert first.usage.cached_tokens == 0
    assert seen[-1].usage.cached_tokens == 6 * PAGE  # every full page but the one holding the last token
    assert all(o.token_ids == first.token_ids for o in seen)


def test_router_lists_the_colocated_role_and_its_prefill_rate(auto_stack):
    with pdserve.Client(auto_stack.router, timeout=120) as c:
        c.generate(token_ids=prompts(20, seed=2), max_tokens=2, temperature=0, ignore_eos=True)
    (addr,) = auto_stack.colocated
    info = instances(auto_stack.router)[addr]
    assert info.role == pb.INSTANCE_ROLE_COLOCATED and info.state == "up" and info.assigned > 0
    s = stats(addr)
    assert s.prefill_tokens_per_s > 0 and s.kv_pages_total > 0 and s.page_size == PAGE


def test_bad_input(auto_stack):
    (addr,) = auto_stack.colocated
    with channel(addr) as ch:
        stub = internal_pb2_grpc.DecodeStub(ch)
        bad = [
            (dict(prefill_target="127.0.0.1:1"), "prefills itself"),
            (dict(prompt_token_ids=[]), "empty"),
            (dict(prompt_token_ids=[10**6]), "vocabulary"),
            (dict(resumed_text_chars=2), "resumed_text_chars"),
        ]
        for kw, reason in bad:
            req = internal_pb2.DecodeRequest(
                request_id=f"bad-{reason}", sampling=generate_pb2.SamplingParams(max_tokens=2)
            )
            kw.setdefault("prompt_token_ids", [5, 6, 7])
            for k, v in kw.items():
                if isinstance(v, list):
                    getattr(req, k).extend(v)
                else:
                    setattr(req, k, v)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (kw, e.value.details())
            assert reason in e.value.details(), e.value.details()
    assert stack_pools_empty(auto_stack)


def test_int8_colocated_against_disaggregated_int8(model_dir, tmp_path_factory):
    """int8 KV: a colocated engine attends to int8 K/V already inside the prompt (its pool is int8), where a
    prefill instance computes the prompt in full precision and ships int8 pages. Greedy agreement, measured."""
    work = tmp_path_factory.mktemp("colocated-int8")
    with (
        tiny_stack(model_dir, work / "c", kv_dtype="int8", page_size=PAGE, chunk_size=CHUNK, num_colocated=2) as col,
        tiny_stack(model_dir, work / "d", kv_dtype="int8", page_size=PAGE, chunk_size=CHUNK) as dis,
        pdserve.Client(col.router, timeout=120) as q,
        pdserve.Client(dis.router, timeout=120) as a,
    ):
        assert len(col.colocated) == 2
        agree, total, first_diff = greedy_agreement(a, q, [prompts(n, seed=3) for n in LENGTHS])
        print(f"colocated int8 vs disaggregated int8: agreement {agree}/{total}, first divergence {first_diff}")
        assert agree / total >= 0.6
        assert sum(i.assigned for i in instances(col.router).values()) == len(LENGTHS)
        wait_until(lambda: stack_pools_empty(col), timeout=10, what="colocated KV pools empty")
