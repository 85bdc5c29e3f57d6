"""Mixed steps (scheduler.py): decode rows of every running sequence and prefill chunks of several prompts in one
forward, within the step token budget; outputs token-identical to HF greedy (fp32, CPU, kv_dtype auto)."""

from __future__ import annotations

import pytest
from engine_testutil import assert_same_greedy, hf_generate, random_prompt, run_to_completion

from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.scheduler import ScheduledBatch

PAGE, CHUNK, NEW = 4, 8, 12
# prompt length 1, page and chunk edges, a prompt of several chunks
LENGTHS = [1, PAGE - 1, PAGE, PAGE + 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


class StepLog:
    """Records every batch the engine's scheduler hands out: (decode rows, [(request id, prefill tokens)])."""

    def __init__(self, engine, monkeypatch):
        self.steps: list[tuple[int, list[tuple[str, int]]]] = []
        real = engine.scheduler.schedule

        def schedule() -> ScheduledBatch | None:
            batch = real()
            if batch is not None:
                d = batch.num_decode
                prefill = [(s.request_id, n) for s, n in zip(batch.seqs[d:], batch.num_new_tokens[d:])]
                self.steps.append((d, prefill))
            return batch

        monkeypatch.setattr(engine.scheduler, "schedule", schedule)

    def mixed(self) -> list[tuple[int, list[tuple[str, int]]]]:
        """Steps with decode rows and prefill rows of at least two prompts."""
        return [(d, p) for d, p in self.steps if d and len(p) >= 2]


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    cache: dict = {}

    def run(name: str, prompt: list[int]):
        key = (name, tuple(prompt))
        if key not in cache:
            cache[key] = hf_generate(hf_model(name), prompt, NEW)
        return cache[key]

    return run


def staggered(engine, prompts: dict[str, list[int]], waves: list[list[str]], sp=GREEDY, gap: int = 3) -> dict:
    """Add the requests wave by wave, `gap` steps apart (later waves arrive while earlier ones decode), then run to
    completion; returns run_to_completion's result over all steps."""
    res: dict = {}

    def collect(outputs) -> None:
        for o in outputs:
            r = res.setdefault(o.request_id, {"tokens": [], "text": "", "outputs": []})
            r["tokens"] += o.new_token_ids
            r["text"] += o.text_delta
            r["outputs"].append(o)

    for wave in waves:
        for rid in wave:
            engine.add_request(EngineRequest(rid, prompts[rid], sp))
        for _ in range(gap):
            collect(engine.step())
    for rid, r in run_to_completion(engine).items():
        res.setdefault(rid, {"tokens": [], "text": "", "outputs": []})
        res[rid]["tokens"] += r["tokens"]
        res[rid]["text"] += r["text"]
        res[rid]["outputs"] += r["outputs"]
    return res


def prompts_by_id() -> dict[str, list[int]]:
    return {f"p{n}": random_prompt(n, seed=200 + n) for n in LENGTHS}


WAVES = [["p19", "p4"], ["p9", "p1", "p5"], ["p3", "p8", "p7"]]


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_staggered_arrivals_in_mixed_steps_match_hf(name, make_engine, hf_greedy, monkeypatch):
    engine = make_engine(name, page_size=PAGE, chunk_size=CHUNK)
    log = StepLog(engine, monkeypatch)
    prompts = prompts_by_id()
    res = staggered(engine, prompts, WAVES)
    for rid, p in prompts.items():
        ref, logits = hf_greedy(name, p)
        assert_same_greedy(res[rid]["tokens"], ref, logits, f"{name} {rid}")
    assert log.mixed(), "some step should decode and prefill several prompts at once"
    for d, prefill in log.steps:  # decode rows + prefill tokens within the budget (chunk_size here)
        assert d + sum(n for _, n in prefill) <= max(CHUNK, d + CHUNK // 4)
        assert sum(n for _, n in prefill) <= engine.scheduler.prefill_budget(d)
    assert engine.allocator.num_used == 0


def test_step_token_budget_bounds_decode_rows_plus_prefill(make_engine, hf_greedy, monkeypatch):
    """A budget below chunk_size: prefill gets budget - decode rows (at least a quarter); outputs unchanged."""
    engine = make_engine("llama", page_size=PAGE, chunk_size=CHUNK, step_token_budget=6)
    assert [engine.scheduler.prefill_budget(d) for d in (0, 1, 4, 5, 9)] == [6, 5, 2, 1, 1]
    log = StepLog(engine, monkeypatch)
    prompts = prompts_by_id()
    res = staggered(engine, prompts, WAVES)
    for rid, p in prompts.items():
        ref, logits = hf_greedy("llama", p)
        assert_same_greedy(res[rid]["tokens"], ref, logits, f"budget 6 {rid}")
    assert any(d and p for d, p in log.steps)
    for d, prefill in log.steps:
        assert sum(n for _, n in prefill) <= max(6 - d, 1)
    assert engine.allocator.num_used == 0


def test_preemption_in_mixed_steps_keeps_greedy_output(make_engine, hf_greedy, monkeypatch):
    """A pool too small for every sequence: mixed steps preempt the newest running sequence, recompute it, and
    every output still matches HF."""
    engine = make_engine("llama", page_size=PAGE, chunk_size=CHUNK, num_pages=14, max_num_seqs=4)
    preempted: list[str] = []
    real = engine.scheduler._preempt
    monkeypatch.setattr(engine.scheduler, "_preempt", lambda s: (preempted.append(s.request_id), real(s)))
    log = StepLog(engine, monkeypatch)
    prompts = {f"q{n}": random_prompt(n, seed=300 + n) for n in (CHUNK + 1, CHUNK, CHUNK - 1, PAGE + 1)}
    res = staggered(engine, prompts, [["q9", "q8"], ["q7"], ["q5"]], gap=2)
    for rid, p in prompts.items():
        ref, logits = hf_greedy("llama", p)
        assert_same_greedy(res[rid]["tokens"], ref, logits, f"preempted {rid}")
    assert preempted, "the pool was meant to force preemption"
    assert any(d and p for d, p in log.steps)
    assert engine.allocator.num_used == 0


def test_stop_conditions_in_mixed_steps_match_runs_alone(make_engine, monkeypatch):
    """Stop token, stop string, max_tokens 1 (the prompt's own step ends it) and min_tokens behave in mixed steps
    exactly as for a request that runs alone."""
    plain = random_prompt(CHUNK + 2, seed=41)
    alone = make_engine("llama", page_size=PAGE, chunk_size=CHUNK)
    free_run = alone.generate([plain], SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))[0]
    text = alone.tokenizer.decode(free_run[2:5], skip_special_tokens=True)
    assert len(text) >= 4, text
    cases = {
        "stop_token": SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=[free_run[3]]),
        "stop_min": SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=[free_run[0]], min_tokens=2),
        "stop_string": SamplingParams(max_tokens=NEW, temperature=0.0, stop=[text[1:4]]),
        "one_token": SamplingParams(max_tokens=1, temperature=0.0),
        "seeded": SamplingParams(max_tokens=NEW, temperature=0.8, seed=7, ignore_eos=True),
    }
    want = {}
    for rid, sp in cases.items():
        e = make_engine("llama", page_size=PAGE, chunk_size=CHUNK)
        e.add_request(EngineRequest(rid, plain, sp))
        r = run_to_completion(e)[rid]
        want[rid] = (r["tokens"], r["text"], r["outputs"][-1].finish_reason, r["outputs"][-1].stop_reason)
    mixed = make_engine("llama", page_size=PAGE, chunk_size=CHUNK)
    log = StepLog(mixed, monkeypatch)
    others = {f"o{n}": random_prompt(n, seed=500 + n) for n in (5, 13)}
    for rid, p in others.items():
        mixed.add_request(EngineRequest(rid, p, GREEDY))
    for _ in range(3):
        mixed.step()
    for rid, sp in cases.items():
        mixed.add_request(EngineRequest(rid, plain, sp))
    res = run_to_completion(mixed)
    for rid in cases:
        r = res[rid]
        got = (r["tokens"], r["text"], r["outputs"][-1].finish_reason, r["outputs"][-1].stop_reason)
        assert got == want[rid], rid
    assert want["stop_token"][0][-1] == free_run[3] and want["one_token"][0] == free_run[:1]
    assert want["stop_string"][2] == "stop" and want["stop_string"][3] in cases["stop_string"].stop
    assert want["stop_min"][2] == "stop" and len(want["stop_min"][0]) >= 2
    assert log.mixed()
    assert mixed.allocator.num_used == 0
