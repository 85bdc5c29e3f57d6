"""Conversions between pdserve.v1 sampling messages and the engine's SamplingParams.

Conversion only: defaults come from `SamplingParams` itself, after the router filled in the model's own
(`with_model_defaults`, from its generation_config.json), and every check is `SamplingParams.validate` (the router
calls it where a request enters; the engine calls it again when the request is added).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from pdserve.engine.sampling import SamplingParams, TokenLogprob
from pdserve.engine.structured_spec import StructuredSpec
from pdserve.models.generation_config import GenerationDefaults
from pdserve.v1 import generate_pb2


def sampling_from_proto(msg: generate_pb2.SamplingParams, max_new_tokens: int | None = None) -> SamplingParams:
    """Unset fields take SamplingParams' defaults. A valid max_tokens is clamped to `max_new_tokens` (the context
    left after the prompt, at least 1), a valid min_tokens with it; an invalid one is kept as sent so that `validate`
    names it."""
    params = SamplingParams()
    if msg.HasField("max_tokens"):
        params.max_tokens = msg.max_tokens
    if msg.HasField("temperature"):
        params.temperature = msg.temperature
    if msg.HasField("top_p"):
        params.top_p = msg.top_p
    if msg.HasField("top_k"):
        params.top_k = msg.top_k
    if msg.HasField("seed"):
        params.seed = msg.seed
    params.stop = list(msg.stop)
    params.stop_token_ids = list(msg.stop_token_ids)
    params.ignore_eos = msg.ignore_eos
    params.logprobs = msg.logprobs
    params.top_logprobs = msg.top_logprobs
    params.prompt_logprobs = msg.prompt_logprobs
    if msg.HasField("max_reasoning_tokens"):
        params.max_reasoning_tokens = msg.max_reasoning_tokens
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if msg.HasField(name):
            setattr(params, name, getattr(msg, name))
    params.logit_bias = dict(msg.logit_bias)
    if msg.HasField("structured"):
        params.structured = structured_from_proto(msg.structured)
    if max_new_tokens is not None and params.max_tokens > 0:
        asked = params.max_tokens
        params.max_tokens = min(params.max_tokens, max(1, max_new_tokens))
        if 0 <= params.min_tokens <= asked:  # a valid min_tokens follows max_tokens down to the context left
            params.min_tokens = min(params.min_tokens, params.max_tokens)
    return params


def structured_from_proto(msg: generate_pb2.StructuredOutput) -> StructuredSpec:
    """The spec of a StructuredOutput message (`kind` "" when none of its fields is set: `validate` names it)."""
    kind = msg.WhichOneof("kind") or ""
    if kind == "choice":
        return StructuredSpec(kind, choices=tuple(msg.choice.choices))
    if kind == "json_object":  # false is the same as unset
        return StructuredSpec(kind if msg.json_object else "")
    return StructuredSpec(kind, getattr(msg, kind) if kind else "")


def with_model_defaults(msg: generate_pb2.SamplingParams, defaults: GenerationDefaults) -> generate_pb2.SamplingParams:
    """A copy of `msg` with the model's defaults in the sampling fields it leaves unset (temperature, top_p, top_k);
    a field the caller set wins, whatever its value (temperature 0 included)."""
    out = generate_pb2.SamplingParams()
    out.CopyFrom(msg)
    if defaults.temperature is not None and not msg.HasField("temperature"):
        out.temperature = defaults.temperature
    if defaults.top_p is not None and not msg.HasField("top_p"):
        out.top_p = defaults.top_p
    if defaults.top_k is not None and not msg.HasField("top_k"):
        out.top_k = defaults.top_k
    return out


def logprob_to_proto(lp: TokenLogprob) -> generate_pb2.TokenLogprob:
    return generate_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


@dataclass(frozen=True)
class MalformedMessage:
    """What `lenient_parser` hands the servicer for bytes that do not parse (e.g. a string field with invalid
    UTF-8): the servicer answers INVALID_ARGUMENT with `reason` (gRPC itself would answer INTERNAL)."""

    type_name: str
    reason: str

    def __str__(self) -> str:
        return f"malformed {self.type_name}: {self.reason} (string fields must be valid UTF-8)"


def lenient_parser(message_type: Any) -> Callable[[bytes], Any]:
    """A request deserializer for a gRPC method handler: the parsed message, or a `MalformedMessage`."""

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return MalformedMessage(message_type.DESCRIPTOR.full_name, str(e))

    return parse


def prompt_logprobs_to_proto(
    lps: list[TokenLogprob],
) -> tuple[list[float], list[generate_pb2.TopLogprobs]]:
    """The engine's prompt logprobs as the wire carries them: the values, and their alternatives (empty unless the
    request asked for top_logprobs)."""
    values = [lp.logprob for lp in lps]
    if not any(lp.top for lp in lps):
        return values, []
    tops = [
        generate_pb2.TopLogprobs(top=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]) for lp in lps
    ]
    return values, tops
