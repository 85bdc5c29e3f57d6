"""Conversions between pdserve.v1 sampling messages and the engine's SamplingParams."""
from __future__ import annotations

from pdserve.engine.sampling import SamplingParams
from pdserve.v1 import generate_pb2

DEFAULT_MAX_TOKENS = 16


def sampling_from_proto(msg: generate_pb2.SamplingParams, max_new_tokens: int) -> SamplingParams:
    """Apply defaults, validate (ValueError with a reason) and clamp max_tokens to the context left."""
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    params = SamplingParams(
        max_tokens=max(1, min(max_tokens, max_new_tokens)),
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )
    params.validate()
    return params
