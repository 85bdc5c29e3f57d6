"""The colocated engine's auto step budget (`pdserve.decode.step_budget`): the choice from measured step costs
(a cost model stands in for the GPU), the measurement itself on a real CPU engine driven by a fake clock, and
the engine's state and outputs afterwards (token-identical to HF with full-precision KV)."""

from __future__ import annotations

import pytest

from pdserve.decode.step_budget import (
    StepCosts,
    choose_prefill_tokens,
    fixed_cost_ms,
    measure_step_costs,
    resolve_step_budget,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.testing.hf_reference import hf_greedy

SIZES = (512, 1024, 2048, 4096)


def costs_of(ms, rows: int = 16) -> StepCosts:
    return StepCosts(rows, ms(0), {p: ms(p) for p in SIZES})


def test_h200_like_costs_choose_2048():
    """8B on an H200: ~4.5 ms of weight read per step, 48.6 ms for 2048 prompt tokens. 1024-token steps spend 16%
    of their time on the fixed cost, 2048-token ones 8.5%; a 4096-token step (102 ms) stalls decoding too long."""
    costs = costs_of(lambda p: 4.5 + 0.0237 * p)
    assert fixed_cost_ms(costs) == pytest.approx(4.5)
    assert choose_prefill_tokens(costs) == 2048
    assert costs.tokens_per_s(2048) == pytest.approx(2048 / 53.04e-3, rel=1e-3)


def test_host_bound_small_steps_raise_the_fixed_cost():
    """Small steps bound at 20 ms by the host's launches: the fitted fixed cost grows and so does the step."""
    slow = costs_of(lambda p: max(20.0, 1.0 + 0.012 * p))
    fast = costs_of(lambda p: 1.0 + 0.012 * p)
    assert fixed_cost_ms(slow) > fixed_cost_ms(fast)
    assert choose_prefill_tokens(fast) == 1024  # 1 ms of 13.3: under 10%
    assert choose_prefill_tokens(slow) == 4096


def test_cheap_steps_choose_the_smallest_and_long_steps_the_largest_that_fits():
    assert choose_prefill_tokens(costs_of(lambda p: 0.1 + 0.01 * p)) == 512
    # the fixed cost never gets under 10% of a step of <= 100 ms: the largest such step
    assert choose_prefill_tokens(costs_of(lambda p: 30.0 + 0.01 * p)) == 4096
    assert choose_prefill_tokens(costs_of(lambda p: 30.0 + 0.04 * p)) == 1024
    # no step is that short: the smallest
    assert choose_prefill_tokens(costs_of(lambda p: 200.0 + p)) == 512
    assert choose_prefill_tokens(StepCosts(0, 1.0, {256: 50.0})) == 256


def test_attention_bending_the_line_does_not_hide_the_weight_read():
    """A quadratic term (attention over the prompt) lowers the fitted intercept below the weight read; the
    decode-only step (4.5 ms) still counts as the fixed cost, so 1024-token steps (16% of theirs) are not chosen."""
    costs = costs_of(lambda p: 4.5 + 0.0225 * p + 4e-7 * p * p)
    assert fixed_cost_ms(StepCosts(16, 0.0, costs.mixed_ms)) < 4.0  # the line alone
    assert fixed_cost_ms(costs) == pytest.approx(4.5)
    assert choose_prefill_tokens(costs) == 2048


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    cfg = EngineConfig(
        model_dir=str(model_dir),
        device="cpu",
        dtype="float32",
        kv_dtype="auto",
        page_size=4,
        chunk_size=8,
        step_token_budget=-1,
        max_num_seqs=8,
        num_pages=256,
    )
    return LLMEngine(cfg)


class FakeDevice:
    """A clock that advances by a cost model at each engine step: `fixed_ms` + 0.5 ms per prefill token + 0.1 ms
    per decode row."""

    def __init__(self, engine: LLMEngine, monkeypatch, fixed_ms: float = 2.0):
        self.now = 0.0
        real = engine.step

        def step(*a, **kw):
            out = real(*a, **kw)
            if engine.last_step_scheduled:
                d, p = engine.last_step_decode_rows, engine.last_step_prefill_tokens
                self.now += (fixed_ms + 0.5 * p + 0.1 * d) / 1e3
            return out

        monkeypatch.setattr(engine, "step", step)

    def clock(self) -> float:
        return self.now


def test_measurement_times_mixed_steps_and_leaves_the_engine_as_it_was(engine, monkeypatch, hf_model):
    fake = FakeDevice(engine, monkeypatch)
    free, sizes = engine.allocator.num_free, (engine.scheduler.chunk_size, engine.scheduler.step_token_budget)
    assert sizes == (8, 8)  # -1 (auto) is --chunk-size until resolved
    costs = measure_step_costs(engine, sizes=(8, 16, 32), decode_rows=3, reps=2, clock=fake.clock)
    assert costs.decode_rows == 3
    assert costs.decode_ms == pytest.approx(2.3)
    assert costs.mixed_ms == pytest.approx({p: 2.3 + 0.5 * p for p in (8, 16, 32)})
    assert fixed_cost_ms(costs) == pytest.approx(2.3)
    assert not engine.has_unfinished_requests() and engine.allocator.num_free == free
    assert (engine.scheduler.chunk_size, engine.scheduler.step_token_budget) == sizes
    assert engine.scheduler.idle_chunk_size == 0
    # the engine still computes exactly: greedy equals HF's with full-precision KV, prompts of several chunks
    # beside each other's decode rows
    prompts = [[(11 * k + 5 * i) % 250 + 3 for i in range(n)] for k, n in enumerate((21, 3, 9))]
    got = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert got == [hf_greedy(hf_model, p, 6) for p in prompts]


def test_sizes_the_pool_cannot_hold_are_skipped(engine, monkeypatch):
    fake = FakeDevice(engine, monkeypatch)
    costs = measure_step_costs(engine, sizes=(8, 4096), decode_rows=2, reps=1, clock=fake.clock)
    assert list(costs.mixed_ms) == [8]  # 4096 tokens: more than the pool (256 pages of 4) and the context
    with pytest.raises(ValueError, match="no step size"):
        measure_step_costs(engine, sizes=(4096,), decode_rows=2, reps=1, clock=fake.clock)
    assert not engine.has_unfinished_requests()


def test_cpu_keeps_chunk_size_and_reports_no_prior(engine):
    budget = resolve_step_budget(engine, measure=True)
    assert (budget.chunk_size, budget.step_token_budget, budget.prior_tokens_per_s) == (8, 8, None)
    assert (engine.scheduler.chunk_size, engine.scheduler.step_token_budget) == (8, 8)


def test_gpu_path_applies_the_measured_choice_and_outputs_stay_exact(engine, monkeypatch, hf_model):
    """The measured path as on a GPU (the device stood in for by the cost model): fixed cost 0.8 ms (0.5 + three
    decode rows), so 8-token steps spend 17% on it and 16-token ones 9%: 16 prefill tokens per step, every decode
    row on top, and the rate at 16 as the prior; 32 (the largest measured) while nothing decodes. Greedy outputs
    under those sizes (a 37-token prompt's first step alone takes 32) still equal HF's."""
    fake = FakeDevice(engine, monkeypatch, fixed_ms=0.5)
    measure = lambda e: measure_step_costs(e, sizes=(8, 16, 32), decode_rows=3, reps=1, clock=fake.clock)  # noqa: E731
    try:
        budget = resolve_step_budget(engine, measure=True, gpu=True, measurer=measure)
        assert (budget.chunk_size, budget.step_token_budget) == (16, 16 + 8)  # max_num_seqs 8
        assert (engine.scheduler.chunk_size, engine.scheduler.step_token_budget) == (16, 24)
        assert budget.prior_tokens_per_s == pytest.approx(16 / 8.8e-3)
        assert "fixed cost 0.8 ms: 16" in budget.reason
        # nothing decoding: a step may take the largest size measured
        assert budget.idle_chunk_size == engine.scheduler.idle_chunk_size == 32
        assert "32 prefill tokens per step while nothing decodes" in budget.reason
        prompts = [[(13 * k + 3 * i) % 250 + 3 for i in range(n)] for k, n in enumerate((37, 5, 16, 2))]
        got = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        assert got == [hf_greedy(hf_model, p, 5) for p in prompts]
        no_warmup = resolve_step_budget(engine, measure=False, gpu=True)
        assert (no_warmup.chunk_size, no_warmup.step_token_budget, no_warmup.prior_tokens_per_s) == (2048, 2056, None)
    finally:
        engine.scheduler.set_budget(8, 8)
