"""Helpers shared by the engine tests (imported as a plain module; pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict:
    """Step until idle; returns {request_id: {"tokens": [...], "text": str, "outputs": [StepOutput]}}."""
    res: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return res
        for o in engine.step():
            r = res.setdefault(o.request_id, {"tokens": [], "text": "", "outputs": []})
            r["tokens"] += o.new_token_ids
            r["text"] += o.text_delta
            r["outputs"].append(o)
    raise AssertionError("engine did not finish")


def forced_logits(engine: LLMEngine, prompts: list[list[int]], forced: list[list[int]]) -> torch.Tensor:
    """Teacher-forced per-step logits [sum of steps, V] (float32) for each prompt's forced continuation (one
    request per prompt)."""
    rows: dict[str, list[torch.Tensor]] = {}
    for i, (p, f) in enumerate(zip(prompts, forced)):
        engine.add_request(
            f"r{i}", p, SamplingParams(max_tokens=len(f), temperature=0.0, ignore_eos=True), forced_token_ids=f
        )
    while engine.has_unfinished_requests():
        for o in engine.step(return_logits=True):
            rows.setdefault(o.request_id, []).append(o.logits)
    return torch.cat([torch.stack(rows[f"r{i}"]) for i in range(len(prompts))])
