"""Prefill fairness (scheduler.py): a long prompt's chunks never hold short requests back by more than a step,
and the long prompt still advances every step. Steps are counted, not seconds."""

from __future__ import annotations

import pytest
from engine_testutil import random_prompt, run_to_completion

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import HEAD_SHARE, share_prefill_budget
from pdserve.models.checkpoints import build_checkpoint

LONG, SHORT, CHUNK, PAGE = 4000, 40, 512, 16
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


# ---- the share rule alone ----------------------------------------------------------------------------------------
def test_share_gives_the_oldest_a_quarter_then_shortest_remaining_first():
    assert share_prefill_budget([4000, 40, 30], 512) == [442, 40, 30]  # shorts whole, the rest to the oldest
    assert share_prefill_budget([4000, 500, 3000], 512) == [128, 384, 0]  # then fewest tokens left first
    assert share_prefill_budget([100, 4000], 512) == [100, 412]  # a short oldest is done in one step
    assert share_prefill_budget([3000, 3000, 3000], 512) == [512, 0, 0]  # equal lengths: arrival order (FIFO)
    assert share_prefill_budget([7], 3) == [3]
    assert share_prefill_budget([5, 5], 1) == [1, 0]


@pytest.mark.parametrize("remaining", [[4000] + [30] * 40, [10, 20, 4000, 5], [600, 600, 600, 1]])
def test_share_never_exceeds_the_budget_nor_starves_the_oldest(remaining):
    for budget in (1, 8, 100, 512):
        give = share_prefill_budget(remaining, budget)
        assert sum(give) == min(budget, sum(remaining))
        assert all(0 <= g <= r for g, r in zip(give, remaining))
        assert give[0] >= min(remaining[0], max(1, budget // HEAD_SHARE))


# ---- an engine: a 4,000-token prompt beside a short-request tenant --------------------------------------------------
@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("long"), arch="llama", max_position_embeddings=8192)


def engine(model_dir) -> LLMEngine:
    cfg = EngineConfig(
        model_dir=str(model_dir),
        device="cpu",
        dtype="float32",
        kv_dtype="auto",
        page_size=PAGE,
        chunk_size=CHUNK,
        num_pages=400,
        max_num_seqs=16,
    )
    return LLMEngine(cfg)


def first_token_step(outputs_by_step: list[list], rid: str) -> int:
    return next(
        i for i, outs in enumerate(outputs_by_step) if any(o.request_id == rid and o.new_token_ids for o in outs)
    )


def test_short_requests_beside_a_long_prompt_get_their_first_token_in_the_next_step(long_model):
    """The long prompt starts first; short requests arriving during its prefill (one per step, a steady tenant)
    each get their first token in the step after their arrival, and the long prompt still finishes within the
    steps its guaranteed quarter of the budget allows."""
    e = engine(long_model)
    e.add_request(EngineRequest("long", random_prompt(LONG, seed=1), GREEDY))
    steps: list[list] = [e.step()]  # the long prompt has started
    arrived: dict[str, int] = {}
    for i in range(12):
        rid = f"short{i}"
        e.add_request(EngineRequest(rid, random_prompt(SHORT, seed=10 + i), GREEDY))
        arrived[rid] = len(steps)
        steps.append(e.step())
    while e.has_unfinished_requests():
        steps.append(e.step())
    for rid, at in arrived.items():
        assert first_token_step(steps, rid) == at, f"{rid} arrived before step {at}"
    long_done = first_token_step(steps, "long")
    assert long_done >= -(-LONG // CHUNK)  # it shared its steps: alone it takes ceil(4000 / 512) = 8
    assert long_done < -(-LONG // (CHUNK // HEAD_SHARE))  # never below its quarter of a step
    assert e.allocator.num_used == 0


def test_long_prompt_outputs_unchanged_by_the_short_tenant(long_model):
    """The same tokens for the long prompt and a short one whether they share steps or run alone."""
    long_p, short_p = random_prompt(LONG, seed=1), random_prompt(SHORT, seed=10)
    want = {}
    for rid, p in (("long", long_p), ("short", short_p)):
        e = engine(long_model)
        e.add_request(EngineRequest(rid, p, GREEDY))
        want[rid] = run_to_completion(e)[rid]["tokens"]
    e = engine(long_model)
    e.add_request(EngineRequest("long", long_p, GREEDY))
    e.step()
    e.add_request(EngineRequest("short", short_p, GREEDY))
    got = {rid: r["tokens"] for rid, r in run_to_completion(e).items()}
    assert got == want
