"""A model's generation_config.json read as its sampling defaults (Hugging Face's reading of the keys)."""

from __future__ import annotations

import json

import pytest

from pdserve.models.generation_config import GenerationDefaults


def test_sampling_keys_are_the_defaults():
    d = GenerationDefaults.from_dict({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert (d.temperature, d.top_p, d.top_k, d.ignored) == (0.6, 0.95, 20, ())
    assert d.describe() == "temperature 0.6, top_p 0.95, top_k 20"


def test_absent_keys_leave_pdserves_defaults():
    d = GenerationDefaults.from_dict({"bos_token_id": 1, "eos_token_id": [2, 7], "top_p": 0.9})
    assert (d.temperature, d.top_p, d.top_k) == (None, 0.9, None)
    assert GenerationDefaults.from_dict({}) == GenerationDefaults()
    assert "pdserve's" in GenerationDefaults().describe()


def test_do_sample_false_is_greedy():
    """Hugging Face's generate: do_sample false means greedy, whatever temperature / top_p / top_k say."""
    d = GenerationDefaults.from_dict({"do_sample": False, "temperature": 0.7, "top_p": 0.8, "top_k": 5})
    assert (d.temperature, d.top_p, d.top_k) == (0.0, None, None)
    assert GenerationDefaults.from_dict({"temperature": 0}).temperature == 0.0  # 0: greedy too


def test_unsupported_and_out_of_range_values_are_ignored_and_named():
    d = GenerationDefaults.from_dict(
        {"temperature": -1, "top_p": 0, "top_k": 2.5, "repetition_penalty": 1.05, "min_p": 0.1, "typical_p": 1.0}
    )
    assert (d.temperature, d.top_p, d.top_k) == (None, None, None)
    text = d.describe()
    for part in ("temperature=-1 (out of range)", "top_p=0 (out of range)", "top_k=2.5 (not an integer)",
                 "repetition_penalty=1.05 (the engine does not support it)", "min_p=0.1"):  # fmt: skip
        assert part in text, text
    assert "typical_p" not in text  # its neutral value changes nothing
    assert GenerationDefaults.from_dict({"repetition_penalty": 1.0}).ignored == ()


def test_read_from_the_model_directory(tmp_path):
    assert GenerationDefaults.from_model_dir(tmp_path) == GenerationDefaults()  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "top_p": 0.9}))
    assert GenerationDefaults.from_model_dir(tmp_path) == GenerationDefaults(temperature=0.2, top_p=0.9)
    (tmp_path / "generation_config.json").write_text("{not json")
    assert GenerationDefaults.from_model_dir(tmp_path) == GenerationDefaults()


@pytest.mark.parametrize("value", [True, "0.5", None])
def test_non_numbers_are_not_taken(value):
    assert GenerationDefaults.from_dict({"temperature": value}).temperature is None
