"""A prompt-cache hit that leaves one token to compute on a CUDA engine: its first step is a decode launch through
the CUDA graphs, one step ahead (`overlap_decode`), and must write the cached pages before it. CUDA only; the CPU
test with `overlap_decode="on"` is test_engine_cached_pages.py."""

from __future__ import annotations

import pytest
import torch
from engine_testutil import export_payloads, layout_for, random_prompt

from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PAGE = 16


def hit_tokens(engine, prompt: list[int], pages) -> list[int]:
    engine.runner.kv_cache.data.normal_()  # free pages still hold this prompt's KV: only the import may restore it
    engine.add_request(EngineRequest("hit", prompt, GREEDY, cached_pages=pages))
    got: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            got += o.new_token_ids
    assert engine.allocator.num_used == 0
    return got


@pytest.mark.parametrize("cached_format", ["auto", "int8"])
def test_all_but_the_last_token_cached(make_engine, cached_format):
    kw = dict(device="cuda", dtype="bfloat16", page_size=PAGE, chunk_size=64, kv_dtype="auto")
    engine = make_engine("llama", **kw)
    assert engine.overlap_decode  # the path under test: decode steps launched one ahead through the graphs
    prompt = random_prompt(3 * PAGE + 1, seed=11)
    engine.add_request(EngineRequest("src", prompt, GREEDY, prefill_only=True))
    while not any(o.finished for o in engine.step()):
        pass
    pages = export_payloads(engine, "src", [0, 1, 2], layout_for(engine, cached_format))
    engine.release("src")
    ref = hit_tokens(make_engine("llama", overlap_decode="off", **kw), prompt, pages)  # steps one at a time
    assert hit_tokens(engine, prompt, pages) == ref
