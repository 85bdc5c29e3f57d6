"""Teacher-forced logits from the engine (tests against references, quality benchmarks)."""

from __future__ import annotations

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams


def forced_logits(engine: LLMEngine, prompts: list[list[int]], forced: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, the float32 logits [len(forced[i]), V] the model produced at each step while its continuation
    was forced to `forced[i]` (one request per prompt, run together)."""
    rows: dict[str, list[torch.Tensor]] = {}
    for i, (p, f) in enumerate(zip(prompts, forced)):
        sampling = SamplingParams(max_tokens=len(f), temperature=0.0, ignore_eos=True)
        engine.add_request(EngineRequest(f"tf{i}", p, sampling, forced_token_ids=f))
    while engine.has_unfinished_requests():
        for o in engine.step(return_logits=True):
            assert o.logits is not None  # return_logits: every sampled step carries its row
            rows.setdefault(o.request_id, []).append(o.logits)
    return [torch.stack(rows[f"tf{i}"]) for i in range(len(prompts))]
