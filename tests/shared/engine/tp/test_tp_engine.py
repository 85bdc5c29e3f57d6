"""An LLMEngine at `tensor_parallel_size` 2 (its ModelRunner starts rank 1 as a child process, gloo on CPU) against
the same engine at TP=1: greedy tokens, prompt logprobs (several LOGITS blocks per step), seeded forks (n > 1: the
copy-on-write page copy runs on every rank), and the follower messages (LOGITS, COPY) refused when malformed."""

from __future__ import annotations

import psutil
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.tp.follower import engine_config_from_json
from pdserve.engine.tp.worker import COPY, LOGITS, copy_message, decode_copy, decode_rows, logits_message
from pdserve.models.checkpoints import build_checkpoint

PROMPTS = [[5 + (7 * i + 13 * j) % 500 for j in range(n)] for i, n in enumerate((1, 6, 19))]


def test_logits_and_copy_messages_round_trip_and_refuse_bad_ones():
    assert int(logits_message([3, 0])[0]) == LOGITS and decode_rows(logits_message([3, 0]), 4) == [3, 0]
    with pytest.raises(ValueError, match="outside the last step"):
        decode_rows(logits_message([4]), 4)
    msg = copy_message([1, 2], [5, 6])
    assert int(msg[0]) == COPY and decode_copy(msg, 8) == ([1, 2], [5, 6])
    with pytest.raises(ValueError, match="outside the pool"):
        decode_copy(msg, 6)
    with pytest.raises(ValueError, match="does not match its count"):
        decode_copy(msg[:-1], 8)
    with pytest.raises(ValueError, match="copy of 1 pages to 2"):
        copy_message([1], [2, 3])


def test_follower_config_json_refuses_unknown_fields():
    with pytest.raises(ValueError, match="EngineConfig's fields"):
        engine_config_from_json('{"model_dir": "x", "evil": 1}')
    with pytest.raises(ValueError, match="EngineConfig's fields, got int"):
        engine_config_from_json("7")
    with pytest.raises(ValueError, match="tensor_parallel_size must be in"):
        engine_config_from_json('{"model_dir": "x", "tensor_parallel_size": 0}')


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    shape = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=96)
    return build_checkpoint(tmp_path_factory.mktemp("tp_engine") / "model", arch="llama", seed=3, **shape)


def run(engine: LLMEngine) -> dict:
    """Greedy tokens with prompt logprobs, and a seeded n=2 request, all at once."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"g{i}", p, greedy))
    sampled = SamplingParams(max_tokens=5, temperature=0.8, seed=11, ignore_eos=True)
    engine.add_request(EngineRequest("forks", PROMPTS[2], sampled, n=2))
    tokens: dict = {}
    lps: dict = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(lp.logprob for lp in o.prompt_logprobs)
    return {"tokens": tokens, "prompt_logprobs": lps}


def test_tp2_engine_matches_tp1(model_dir):
    torch.set_num_threads(1)
    common = dict(model_dir=str(model_dir), device="cpu", kv_dtype="auto", page_size=4, chunk_size=8, num_pages=64)
    want = run(LLMEngine(EngineConfig(**common)))
    engine = LLMEngine(EngineConfig(**common, tensor_parallel_size=2))
    supervisor = engine.runner._supervisor
    assert supervisor is not None and engine.runner.num_local_kv_heads == 1
    follower = psutil.Process(supervisor.followers[0].pid)
    got = run(engine)
    assert got["tokens"] == want["tokens"]
    assert set(got["tokens"]) >= {("forks", 0), ("forks", 1)}
    for rid, values in want["prompt_logprobs"].items():
        torch.testing.assert_close(torch.tensor(got["prompt_logprobs"][rid]), torch.tensor(values))
    supervisor.stop()  # a clean end: SHUTDOWN, the follower returns 0
    assert supervisor.followers[0].wait(10) == 0 and not follower.is_running()


def test_a_tp_size_the_model_cannot_split_fails_before_any_rank_starts(model_dir):
    cfg = EngineConfig(model_dir=str(model_dir), device="cpu", num_pages=8, tensor_parallel_size=4)
    before = psutil.Process().children()
    with pytest.raises(ValueError, match="num_attention_heads 6 is not divisible by tensor_parallel_size 4"):
        LLMEngine(cfg)
    assert psutil.Process().children() == before


def prefill_batches(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[list, int]:
    """A prefill-only request's exported page batches (the engine's pool layout) and its first token."""
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0), prefill_only=True))
    batches, first = [], None
    while first is None:
        for o in engine.step():
            if o.ready_pages:
                batches.append(engine.export_batch(rid, o.ready_pages, engine.pool_layout))
            if o.finished:
                first = o.new_token_ids[0]
    engine.release(rid)
    return batches, first


def decode_imported(engine: LLMEngine, rid: str, prompt: list[int], batches: list, first: int) -> list[int]:
    engine.begin_import(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for b in batches:
        engine.import_batch(rid, b.page_indexes, b.num_tokens, b.rows, engine.pool_layout)
    engine.finish_import(rid, first)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    return tokens


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_tp3_decode_imports_a_tp1_prefills_quantized_pages(model_dir, kv_dtype):
    """Pages of both KV heads (int8 / fp8 with scales) from a TP=1 prefill: each of 3 ranks keeps the heads it holds
    ([0, 0], [0, 1], [1, 1]); the decoded tokens equal a TP=1 decode's of the same pages."""
    common = dict(model_dir=str(model_dir), device="cpu", kv_dtype=kv_dtype, page_size=4, chunk_size=8, num_pages=32)
    prompt = PROMPTS[2]
    prefill = LLMEngine(EngineConfig(**common))
    batches, first = prefill_batches(prefill, "p", prompt)
    want = decode_imported(LLMEngine(EngineConfig(**common)), "d", prompt, batches, first)
    engine = LLMEngine(EngineConfig(**common, tensor_parallel_size=3))
    assert decode_imported(engine, "d", prompt, batches, first) == want
    assert engine.runner._supervisor is not None
    engine.runner._supervisor.stop()
