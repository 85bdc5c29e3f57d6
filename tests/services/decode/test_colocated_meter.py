"""The colocated instance's prefill capacity (`PrefillRateMeter`), measured on a real CPU engine's mixed steps:
prefill tokens over the whole time of the steps that prefilled, decode rows included; steps that filled at least
half their prefill budget set the capacity, smaller ones only until such a step was measured."""

from __future__ import annotations

import pytest

from pdserve.decode.colocated import PrefillRateMeter
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams

MS = 1_000_000  # ns
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model_dir) -> LLMEngine:
    cfg = EngineConfig(
        model_dir=str(model_dir), device="cpu", dtype="float32", kv_dtype="auto", page_size=4, chunk_size=16
    )
    return LLMEngine(cfg)


def step(engine: LLMEngine, meter: PrefillRateMeter, ms: int) -> None:
    """One engine step, reported to the meter as lasting `ms` milliseconds."""
    engine.step()
    meter(engine, 0, ms * MS)


def test_small_steps_count_until_a_full_mixed_step_is_measured(engine):
    meter = PrefillRateMeter(engine)
    assert meter.rate() is None
    engine.add_request(EngineRequest("a", [5, 6, 7], GREEDY))  # 3 of 16 prefill tokens: not a full step
    step(engine, meter, 10)
    assert engine.last_step_prefill_tokens == 3 and meter.full.rate() is None
    assert meter.rate() == pytest.approx(300.0)
    step(engine, meter, 10)  # a pure decode step: no prefill, not counted
    assert engine.last_step_prefill_tokens == 0 and meter.rate() == pytest.approx(300.0)
    engine.add_request(EngineRequest("b", list(range(10, 50)), GREEDY))  # 40 tokens beside a's decode row
    step(engine, meter, 20)
    assert engine.last_step_decode_rows == 1
    assert engine.last_step_prefill_tokens == engine.last_step_prefill_budget == 15  # budget 16 less one row
    assert meter.rate() == pytest.approx(750.0)  # the full mixed step alone: 15 tokens in 20 ms
    step(engine, meter, 20)
    engine.add_request(EngineRequest("c", [8, 9], GREEDY))  # beside b's last 10 tokens: 12 of 15, full
    step(engine, meter, 16)
    assert engine.last_step_prefill_tokens == 12 and meter.rate() == pytest.approx(750.0)
    engine.add_request(EngineRequest("d", [11, 12], GREEDY))  # 2 tokens beside three decode rows: small
    step(engine, meter, 100)
    assert engine.last_step_decode_rows == 3 and engine.last_step_prefill_tokens == 2
    assert meter.any.rate() < 700 and meter.rate() == pytest.approx(750.0)  # the full steps' rate stands
    while engine.has_unfinished_requests():
        engine.step()


def test_the_start_up_prior_stands_until_a_full_step_is_measured(engine):
    """The capacity measured at start-up (`pdserve.decode.step_budget`) is reported before any step, and above the
    rate of small steps (which understates capacity); the first full mixed step replaces it."""
    meter = PrefillRateMeter(engine, prior=40_000.0)
    assert meter.rate() == 40_000.0
    engine.add_request(EngineRequest("p-small", [5, 6, 7], GREEDY))  # 3 of 16 prefill tokens: not a full step
    step(engine, meter, 10)
    assert meter.any.rate() == pytest.approx(300.0) and meter.rate() == 40_000.0
    engine.add_request(EngineRequest("p-full", list(range(10, 50)), GREEDY))
    step(engine, meter, 20)  # 15 tokens in 20 ms beside one decode row
    assert engine.last_step_prefill_tokens == 15 and meter.rate() == pytest.approx(750.0)
    while engine.has_unfinished_requests():
        engine.step()
