"""Hugging Face transformers as the reference the serving stack is checked against: a checkpoint loaded in fp32
and its greedy continuation."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf_model(model_dir: Path | str):
    """The checkpoint at `model_dir` as an HF causal LM, fp32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation of `ids`, `n` tokens, EOS not special (like ignore_eos)."""
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
    )
    return out[0, len(ids) :].tolist()
