"""Start-up warm-up: run the code paths a first request would take on throwaway requests before a service reports
ready, so that no user request pays their one-time costs (Triton JIT compiles, cuBLAS / FA3 handles, the CUDA
host allocator's first pinned blocks).

Without it the first request of a fresh service pays about a second of compiles on a GPU, ten times a later one's
prefill, and the first prompt-cache hit pays again (its int8 pages are dequantized into the prefill's dense pool
by a kernel nothing else compiles).

Paths covered: prompts of 1 token, one page plus one token, 2^k pages plus one token up to a chunk (each GEMM and
attention shape picks its kernel by its row count: a prompt tail of a size not seen here loads that kernel on first
use) and one chunk plus one page plus one token (a chunk that attends to an earlier chunk); a decode step; a mixed
step (decode rows beside a prefill chunk, run eagerly); a prefill-only request exported in each format a prefill
ships; a cached prefix imported in each of those formats (a request left one token to compute: its first step is a
decode launch, which writes the cached pages first).

It pays on a GPU only. On CPU nothing compiles and a first request costs what a later one does, while the full
warm-up (a chunk-long prompt through plain torch ops) took over a minute on a 2-core host: `light` runs one
1-token prompt there (a few ms: first-touch of the torch runtime and the pool's first page).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

import torch

from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.kv.codec import KVLayoutSpec
from pdserve.kv.payload import PagePayload

log = logging.getLogger("pdserve")


def warm_up(engine: LLMEngine, ship_formats: Sequence[tuple[str, int]] = (), light: bool = False) -> float:
    """Run the warm-up requests to completion and drop them; returns the seconds it took. `ship_formats`:
    (kv dtype, group size) of the KV a prefill exports and imports from its prompt cache ("auto": the model's).
    `light`: one 1-token prompt only (CPU, where nothing compiles)."""
    t0 = time.perf_counter()
    ps, chunk = engine.page_size, engine.cfg.chunk_size
    limit = max(1, min(engine.max_model_len - 2, engine.allocator.num_pages // 2 * ps - 2))  # context, half the pool
    sizes = {1, ps + 1, chunk + ps + 1} | {ps * 2**k + 1 for k in range(1, 32) if ps * 2**k < chunk}
    lengths = [1] if light else sorted({min(n, limit) for n in sizes})
    ship_formats = () if light else ship_formats
    mixed = not light and len(lengths) > 1  # two prompts at once: decode rows beside a prefill chunk (mixed step)
    steps = len(lengths) + len(ship_formats) + mixed
    log.info("engine warm-up: %s (%d requests) before reporting ready ...",
             "light, CPU" if light else "compiling kernels and first-use paths", steps)  # fmt: skip
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i, n in enumerate(lengths):  # one at a time: a small pool never preempts
        engine.generate([_prompt(engine, n)], greedy)
        _progress(i + 1, steps, t0, f"{n}-token prompt")
    if mixed:  # the short one decodes while the long one's chunks compute: the eager decode kernels' launches
        engine.generate([_prompt(engine, lengths[1]), _prompt(engine, lengths[-1])], greedy)
        _progress(len(lengths) + 1, steps, t0, "a mixed decode + prefill step")
    for done, (dtype, group) in enumerate(ship_formats, start=len(lengths) + mixed + 1):
        layout = _layout(engine, dtype, group)
        n = min(2 * ps + 1, limit)
        rid = _run(engine, _prompt(engine, n), prefill_only=True)
        engine.export_batch(rid, list(range(n // ps)), layout)
        engine.release(rid)
        if n > ps:  # a cached first page in this format, imported into the pool
            _run(engine, _prompt(engine, ps + 1), cached_pages=[_zero_page(layout)])
        _progress(done, steps, t0, f"{dtype} page export/import")
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)
    seconds = time.perf_counter() - t0
    log.info("engine warm-up: %d prompts, formats %s, %.2f s", len(lengths) + 2 * mixed + 2 * len(ship_formats),
             [f"{d}/{g}" for d, g in ship_formats] or "-", seconds)  # fmt: skip
    return seconds


def _progress(done: int, steps: int, t0: float, what: str) -> None:
    """One log line per warm-up step, with a text bar (a service's output is a log, not a terminal)."""
    bar = "#" * (20 * done // steps)
    log.info("engine warm-up [%-20s] %d/%d %s, %.1f s", bar, done, steps, what, time.perf_counter() - t0)


def _prompt(engine: LLMEngine, n: int) -> list[int]:
    vocab = engine.model_config.vocab_size
    return [(7 * i + 3) % vocab for i in range(n)]


def _layout(engine: LLMEngine, dtype: str, group: int) -> KVLayoutSpec:
    """The page format for (dtype, group): "auto" is the model dtype, unquantized."""
    mc = engine.model_config
    if dtype == "auto":
        dtype, group = engine.kv_storage_dtype_name, 0
    elif dtype == "fp8":
        group = mc.head_dim  # one scale per token and KV head
    return KVLayoutSpec(dtype, engine.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, min(group, mc.head_dim))


def _zero_page(layout: KVLayoutSpec) -> PagePayload:
    shape = (2, layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim)
    data = torch.zeros(shape, dtype=layout.torch_dtype)
    if not layout.quantized:
        return PagePayload(0, layout.page_size, 0, data, None, None, 0)
    scales = torch.ones((*shape[:-1], layout.head_dim // layout.group_size), dtype=torch.float16)
    return PagePayload(0, layout.page_size, 0, data, scales, None, layout.group_size)


def _run(engine: LLMEngine, prompt: list[int], **kw) -> str:
    """Add one greedy request and step until it finished; returns its id."""
    rid = f"warmup-{uuid.uuid4().hex}"
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), **kw))
    done = False
    while not done:
        done = any(o.request_id == rid and o.finished for o in engine.step())
    return rid
