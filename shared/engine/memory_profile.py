"""The activation peak of one engine step on a GPU, measured before the KV pool is sized (its `auto` size is what the
instance's memory share leaves after the weights and this peak).

A step computes at most `step_tokens` rows (decode rows + prefill chunk); its transient memory is the model's
activations (the gate_up output [T, 2I] is the largest, plus FP8 copies of GEMM inputs), a quantized pool's dense
scratch of the batch's context (prefill attention dequantizes the pages it reads: [2, W·ps, KVH, D] per layer), and the
logits of the rows it samples ([rows, vocab] float32, with the sampler's softmax and sort beside them). The profile
runs exactly that once: one sequence whose last `step_tokens` tokens end at the longest context a sequence can have
(the model's, or what a pool could hold if less: the scratch is the longest one a single sequence can need), its
logits for `logits_rows` rows, a softmax and a sort. The sequence's page table cycles over a small temporary pool
(pages beyond the chunk's own are read, never trusted).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.engine.config import EngineConfig

# step_token_budget -1 (auto): the service picks the prefill tokens per step after the pool exists, up to this many
# (pdserve.decode.step_budget.CANDIDATES' largest), with up to max_num_seqs decode rows beside them
AUTO_STEP_MAX_PREFILL = 4096


def step_tokens_bound(cfg: EngineConfig) -> int:
    """The most rows one step of this engine computes: its prefill tokens (--chunk-size, capped by a positive
    --step-token-budget; auto: up to AUTO_STEP_MAX_PREFILL) plus a full decode batch (the scheduler never drops
    decode rows for the budget)."""
    budget, chunk = cfg.step_token_budget, cfg.chunk_size
    prefill = min(chunk, budget) if budget > 0 else chunk if budget == 0 else max(chunk, AUTO_STEP_MAX_PREFILL)
    return prefill + cfg.max_num_seqs


def context_table(context: int, chunk: int, page_size: int, num_pages: int) -> list[int]:
    """Page table of a `context`-token sequence over a pool of `num_pages` pages (ids cycle), such that the last
    `chunk` tokens' slots are distinct: needs num_pages >= ceil(chunk / page_size) + 1."""
    need = -(-chunk // page_size) + 1
    if num_pages < need:
        raise ValueError(f"a {chunk}-token chunk needs {need} distinct pages, the pool has {num_pages}")
    return [i % num_pages for i in range(-(-context // page_size))]


def profile_pages(step_tokens: int, page_size: int) -> int:
    """Pages of the temporary pool the profile writes the chunk's K/V into."""
    return -(-step_tokens // page_size) + 1


def measure_step_peak(
    forward: Callable[[list[int], list[int], list[int], list[list[int]]], torch.Tensor],
    logits: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    step_tokens: int,
    context: int,
    logits_rows: int,
    vocab_size: int,
    page_size: int,
    num_pages: int,
) -> int:
    """Bytes the caching allocator held at the peak of one profiled step above what it held before (weights and the
    temporary pool excluded: both allocated before). `forward(ids, starts, q_lens, tables)` -> hidden [T, H];
    `logits(hidden [R, H])` -> [R, vocab] float32."""
    chunk = min(step_tokens, context)
    start = context - chunk
    table = context_table(context, chunk, page_size, num_pages)
    ids = [(7 * i + 3) % vocab_size for i in range(chunk)]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_reserved(device)
    hidden = forward(ids, [start], [chunk], [table])  # [chunk, H]
    rows = torch.arange(logits_rows, device=device) % chunk
    out = logits(hidden[rows])  # [rows, vocab] float32
    probs = torch.softmax(out, dim=-1)  # the sampler's top-p / top-k path: probabilities sorted with their ids
    torch.sort(probs, dim=-1, descending=True)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_reserved(device) - before
    del hidden, out, probs
    return max(0, peak)
