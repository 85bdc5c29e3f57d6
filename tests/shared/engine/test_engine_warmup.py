"""Start-up warm-up: it runs every path it names on throwaway requests and leaves the engine as it found it (no
pages held, no requests, the same outputs afterwards)."""

from __future__ import annotations

import logging

import pytest

from pdserve.engine.sampling import SamplingParams
from pdserve.engine.warmup import warm_up

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 200, 31, 7, 8, 1, 2, 3, 99], [17, 4]]


@pytest.mark.parametrize(
    ("kv_dtype", "formats", "overlap"),
    [
        ("auto", [("int8", 4)], "auto"),
        ("auto", [("int8", 4)], "on"),  # as on a GPU: the cached-page import goes through the overlapped decode launch
        ("auto", [("auto", 0)], "auto"),
        ("int8", [("int8", 4)], "auto"),
        ("auto", [("fp8", 0)], "auto"),
        ("auto", [], "auto"),
    ],
)
def test_warm_up_runs_its_paths_and_leaves_no_trace(make_engine, caplog, monkeypatch, kv_dtype, formats, overlap):
    engine = make_engine("llama", kv_dtype=kv_dtype, kv_group_size=4, overlap_decode=overlap)
    want = engine.generate(PROMPTS, GREEDY)
    free = engine.allocator.num_free
    calls = {"export_batch": 0, "import_full_pages": 0}
    for name, obj in (("export_batch", engine), ("import_full_pages", engine.runner)):
        orig = getattr(obj, name)

        def counted(*a, _orig=orig, _name=name, **kw):
            calls[_name] += 1
            return _orig(*a, **kw)

        monkeypatch.setattr(obj, name, counted)
    with caplog.at_level(logging.INFO, logger="pdserve"):
        seconds = warm_up(engine, formats)
    assert seconds > 0 and "engine warm-up" in caplog.text
    assert calls == {"export_batch": len(formats), "import_full_pages": len(formats)}
    assert engine.allocator.num_free == free and not engine._seqs
    assert engine.generate(PROMPTS, GREEDY) == want


def test_warm_up_fits_a_short_context(make_engine):
    """Prompt lengths are capped by the model's context (a chunk larger than it is legal)."""
    engine = make_engine("llama", chunk_size=4096)
    assert warm_up(engine, [("int8", 4)]) > 0
