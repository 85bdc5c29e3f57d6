"""Helpers shared by the engine tests (imported as a plain module; pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.testing.teacher_forcing import forced_logits as teacher_forced_logits


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
    """Teacher-forced per-step logits [sum of steps, V] (float32), prompts in order."""
    return torch.cat(teacher_forced_logits(engine, prompts, forced))
