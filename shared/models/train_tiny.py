"""Train a tiny llama checkpoint on the shipped corpus so that its attention (and its KV) is not noise.

Random-init checkpoints have near-uniform attention, which hides KV quantization error. This builds one with
`build_checkpoint` (hidden 256, 2 layers, 4 heads, 2 kv heads -> head_dim 64, vocab 512), trains it with
AdamW on the first 90% of `corpus_text()` for a fixed number of steps (deterministic: fixed seed, step count
derived from `seconds` by a fixed calibration constant, never from the wall clock) and saves it back with
save_pretrained (safetensors). The last 10% of the corpus is held out as eval text.

The default budget (45 s on 2 CPU cores: 180 steps of 16x128 tokens) takes held-out perplexity from ~800 at random
init to ~13, enough for attention to be far from uniform, which the KV-quality checks need. `train_log.json` in
the output dir records each run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from pdserve.models.checkpoints import ModelShape, build_checkpoint, corpus_text

log = logging.getLogger(__name__)

TRAIN_SHAPES = ModelShape(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
SEQ_LEN = 128
BATCH = 16
LR = 3e-3
STEPS_PER_SECOND = 4.0  # calibration: ~0.22 s/step measured on 2 CPU cores, rounded down for shared load


def split_corpus(eval_fraction: float = 0.1) -> tuple[str, str]:
    """(train_text, eval_text): the last `eval_fraction` of the corpus, cut at a line boundary, is eval."""
    text = corpus_text()
    cut = text.rfind("\n", 0, int(len(text) * (1 - eval_fraction))) + 1
    return text[:cut], text[cut:]


def _windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = (ids.numel() - 1) // seq_len
    return ids[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)  # [n, seq_len + 1]


@torch.no_grad()
def eval_perplexity(model, ids: torch.Tensor, seq_len: int = SEQ_LEN, max_windows: int = 32) -> float:
    """Perplexity over non-overlapping windows of the token ids [N] (first max_windows windows)."""
    model.eval()
    win = _windows(ids, seq_len)[:max_windows]
    nll, count = 0.0, 0
    for chunk in win.split(8):
        logits = model(input_ids=chunk[:, :-1]).logits.float()  # [b, T, V]
        nll += torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum").item()
        count += chunk[:, 1:].numel()
    return math.exp(nll / count)


def train_tiny_checkpoint(out_dir: str | Path, seconds: float = 45, seed: int = 0) -> Path:
    """Build + train a tiny llama checkpoint in `out_dir` for round(seconds * STEPS_PER_SECOND) steps."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = build_checkpoint(out_dir, arch="llama", seed=seed, **TRAIN_SHAPES)
    tok = AutoTokenizer.from_pretrained(str(out))
    train_text, eval_text = split_corpus()
    train_ids = torch.tensor(tok(train_text)["input_ids"], dtype=torch.long)
    eval_ids = torch.tensor(tok(eval_text)["input_ids"], dtype=torch.long)
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    steps = max(1, round(seconds * STEPS_PER_SECOND))

    ppl_before = eval_perplexity(model, eval_ids)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    t0 = time.perf_counter()
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, train_ids.numel() - SEQ_LEN - 1, (BATCH,), generator=gen)
        batch = torch.stack([train_ids[s : s + SEQ_LEN + 1] for s in starts.tolist()])  # [B, T + 1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    train_s = time.perf_counter() - t0
    ppl_after = eval_perplexity(model, eval_ids)
    model.save_pretrained(str(out), safe_serialization=True)
    info = dict(
        seed=seed,
        steps=steps,
        batch=BATCH,
        seq_len=SEQ_LEN,
        lr=LR,
        train_seconds=round(train_s, 1),
        final_train_loss=round(loss.item(), 4),
        eval_ppl_before=round(ppl_before, 2),
        eval_ppl_after=round(ppl_after, 2),
        eval_tokens=eval_ids.numel(),
    )
    (out / "train_log.json").write_text(json.dumps(info, indent=1) + "\n")
    log.info("train_tiny: %s", info)
    return out


@torch.no_grad()
def capture_kv(model_dir: str | Path, text: str, max_tokens: int = 512) -> torch.Tensor:
    """Real K/V of `model_dir` on `text` (first max_tokens tokens), as HF caches them (K after RoPE).

    Returns [2 (K, V), layers, T, kv_heads, head_dim] float32 - the PagePayload data layout.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor(tok(text)["input_ids"][:max_tokens], dtype=torch.long)[None]  # [1, T]
    out = model(input_ids=ids, use_cache=True)
    cache = out["cache"] if "cache" in out else out.past_key_values
    k = torch.stack([layer.keys[0] for layer in cache.layers])  # [layers, kv_heads, T, head_dim]
    v = torch.stack([layer.values[0] for layer in cache.layers])
    return torch.stack([k, v]).transpose(2, 3).contiguous()  # [2, layers, T, kv_heads, head_dim]


if __name__ == "__main__":
    import sys

    logging.basicConfig(level=logging.INFO)
    print(
        train_tiny_checkpoint(
            sys.argv[1] if len(sys.argv) > 1 else "/tmp/pdserve-tiny-trained",
            float(sys.argv[2]) if len(sys.argv) > 2 else 45,
        )
    )
