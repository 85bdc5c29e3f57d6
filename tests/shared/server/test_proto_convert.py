"""The model's sampling defaults applied to a request's SamplingParams message: they fill what the caller left
unset, and a field the caller set wins whatever its value."""

from __future__ import annotations

from pdserve.models.generation_config import GenerationDefaults
from pdserve.server.proto_convert import sampling_from_proto, with_model_defaults
from pdserve.v1 import generate_pb2

MODEL = GenerationDefaults(temperature=0.25, top_p=0.5, top_k=3)


def test_unset_fields_take_the_models_defaults():
    msg = generate_pb2.SamplingParams(max_tokens=7, seed=11, stop=["x"])
    out = with_model_defaults(msg, MODEL)
    params = sampling_from_proto(out)
    assert (params.temperature, params.top_p, params.top_k) == (0.25, 0.5, 3)
    assert (params.max_tokens, params.seed, params.stop) == (7, 11, ["x"])  # the rest as sent
    assert not msg.HasField("temperature")  # the caller's message is not changed


def test_explicit_fields_win_zero_included():
    msg = generate_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=0)
    params = sampling_from_proto(with_model_defaults(msg, MODEL))
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 1.0, 0)
    assert params.greedy


def test_a_model_without_defaults_keeps_pdserves():
    params = sampling_from_proto(with_model_defaults(generate_pb2.SamplingParams(), GenerationDefaults()))
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    partial = sampling_from_proto(with_model_defaults(generate_pb2.SamplingParams(), GenerationDefaults(top_p=0.5)))
    assert (partial.temperature, partial.top_p, partial.top_k) == (1.0, 0.5, 0)


def test_penalties_bias_min_tokens_and_structured_output_convert():
    msg = generate_pb2.SamplingParams(
        max_tokens=50,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.5,
        logit_bias={3: -100.0, 9: 2.0},
        min_tokens=40,
        structured=generate_pb2.StructuredOutput(choice=generate_pb2.ChoiceList(choices=["a", "b"])),
    )
    params = sampling_from_proto(msg, max_new_tokens=30)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1.0, 1.5)
    assert params.logit_bias == {3: -100.0, 9: 2.0}
    assert (params.max_tokens, params.min_tokens) == (30, 30)  # min_tokens follows max_tokens to the context left
    assert params.structured is not None and params.structured.choices == ("a", "b")
    params.validate(vocab_size=16)
    regex = sampling_from_proto(generate_pb2.SamplingParams(structured=generate_pb2.StructuredOutput(regex="a+")))
    assert regex.structured is not None and (regex.structured.kind, regex.structured.value) == ("regex", "a+")
    unset = sampling_from_proto(generate_pb2.SamplingParams())
    assert unset.structured is None and not unset.processes_logits  # defaults cost nothing in the sampler
    bad = sampling_from_proto(generate_pb2.SamplingParams(max_tokens=5, min_tokens=6), max_new_tokens=3)
    assert bad.min_tokens == 6  # an invalid value is kept as sent: validate names it
