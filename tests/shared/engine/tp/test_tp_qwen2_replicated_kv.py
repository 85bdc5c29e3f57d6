"""TP=3 on a tiny Qwen2 with 6 query heads and 2 KV heads: 2 KV heads do not split over 3 ranks, so each rank holds
two (copies: [0, 0], [0, 1], [1, 1]); tied embeddings (the LM head's vocabulary shard is the embedding's), q/k/v
biases, an FFN of 128 split 42/43/43, vocabulary 509 (shards of 170, the last one 169). Three gloo processes run
prefill and greedy decode; rank 0's tokens equal the TP=1 run's, logits to float32 rounding (all-reduce order)."""

from __future__ import annotations

import pytest
import torch

from pdserve.models.checkpoints import build_checkpoint
from pdserve.testing.tp_ranks import greedy_rank, single_process_run, spawn_ranks

TP = 3
VARIANTS = [("auto", "none"), ("fp8", "none")]
PROMPTS = [[21, 8, 300, 44, 5, 17], [90, 91, 2, 501, 33, 6, 7, 8, 9]]
NEW_TOKENS = 4
SHAPE = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_qwen2")
    model_dir = build_checkpoint(root / "model", arch="qwen2", vocab_size=509, **SHAPE)
    out = root / "out"
    out.mkdir()
    runs = [(model_dir, kv, q) for kv, q in VARIANTS]
    spawn_ranks(greedy_rank, TP, (str(root / "rendezvous"), runs, PROMPTS, NEW_TOKENS, out))
    return model_dir, {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(TP)}


@pytest.mark.parametrize("index", range(len(VARIANTS)), ids=[f"kv_{k}" for k, _ in VARIANTS])
def test_tp_matches_single_process(run, index):
    model_dir, results = run
    ref_tokens, ref_logits = single_process_run(model_dir, PROMPTS, NEW_TOKENS, VARIANTS[index])
    assert results[0][f"tokens{index}"].tolist() == ref_tokens
    torch.testing.assert_close(results[0][f"logits{index}"], ref_logits, rtol=1e-4, atol=1e-4)
    assert all(results[r][f"steps{index}"] == NEW_TOKENS + 1 for r in (1, 2))


def test_kv_heads_replicated(run):
    _, results = run
    assert [results[r]["kv_heads0"] for r in range(TP)] == [[0, 0], [0, 1], [1, 1]]
