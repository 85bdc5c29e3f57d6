"""TP=2 (two gloo processes, one spawn for every run below): prefill (two chunks) and greedy decode through the rank
runtime; rank 0's tokens equal the single-process (TP=1) run's and its logits match to float32 rounding (the
all-reduce adds the ranks' partial sums in another order than one GEMM: the last bits may differ, so logits are
compared with a tolerance, tokens exactly).

Runs: a tiny Llama (4 query heads, 2 KV heads: one per rank; o_proj and MLP biases: the row-parallel bias is added
once; vocabulary 509, odd: the last logits shard is padded) with KV auto (fp32) and int8 and online FP8 weights; a
Qwen3 (per-head q/k norms, tied embeddings); FP8 checkpoints of a Llama with head_dim 128 in the 128x128 block
format (each rank's heads and FFN columns whole blocks) and the per-channel format."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.quant.fp8_convert import convert_checkpoint
from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.tp_ranks import greedy_rank, single_process_run, spawn_ranks

TP = 2
PROMPTS = [[11, 400, 23, 7, 99, 5, 301], [3, 14, 15, 92, 65]]
NEW_TOKENS = 5
# name -> (model, kv_dtype, quantization)
RUNS = {
    "llama": ("llama", "auto", "none"),
    "llama_kv_int8": ("llama", "int8", "none"),
    "llama_online_fp8": ("llama", "auto", "fp8"),
    "qwen3": ("qwen3", "auto", "none"),
    "fp8_block": ("fp8_block", "auto", "none"),
    "fp8_channel": ("fp8_channel", "auto", "none"),
}
WIDE = dict(hidden_size=128, head_dim=128, intermediate_size=256)  # FP8 blocks: 2 heads of 128 rows per rank


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """({model name: dir}, {rank: saved results}) of one spawn of the TP group over every run."""
    root = tmp_path_factory.mktemp("tp2")
    wide = build_checkpoint(root / "wide", arch="llama", vocab_size=509, **WIDE)
    models = {
        "llama": build_checkpoint(root / "llama", arch="llama", vocab_size=509, attention_bias=True, mlp_bias=True),
        "qwen3": build_checkpoint(root / "qwen3", arch="qwen3", vocab_size=509),
        "fp8_block": convert_checkpoint(wide, root / "fp8_block", "block"),
        "fp8_channel": convert_checkpoint(wide, root / "fp8_channel", "channel"),
    }
    runs = [(models[m], kv, q) for m, kv, q in RUNS.values()]
    out = root / "out"
    out.mkdir()
    spawn_ranks(greedy_rank, TP, (str(root / "rendezvous"), runs, PROMPTS, NEW_TOKENS, out))
    return models, {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(TP)}


@pytest.mark.parametrize("name", RUNS)
def test_tp_matches_single_process(run, name):
    models, results = run
    index = list(RUNS).index(name)
    model, kv_dtype, quantization = RUNS[name]
    ref_tokens, ref_logits = single_process_run(models[model], PROMPTS, NEW_TOKENS, (kv_dtype, quantization))
    assert results[0][f"tokens{index}"].tolist() == ref_tokens
    torch.testing.assert_close(results[0][f"logits{index}"], ref_logits, rtol=1e-4, atol=1e-4)
    assert results[1][f"steps{index}"] == NEW_TOKENS + 1  # the follower ran every step (two prefill chunks)


def test_kv_heads_split_without_copies(run):
    _, results = run
    assert [results[r]["kv_heads0"] for r in range(TP)] == [[0], [1]]
