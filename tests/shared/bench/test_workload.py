"""pdserve.bench.workload: length laws, arrivals, traces, vocabularies and fresh prompts, with known inputs."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest

from pdserve.bench.workload import (
    LengthDist,
    PromptMaker,
    SpecStream,
    Vocabulary,
    load_trace,
    open_loop_specs,
    poisson_arrivals,
)


def test_parse_forms_and_round_trip():
    assert LengthDist.parse("fixed:12") == LengthDist("fixed", 12)
    assert LengthDist.parse("12") == LengthDist("fixed", 12)
    assert LengthDist.parse("uniform:3,9") == LengthDist("uniform", 3, 9)
    d = LengthDist.parse("lognormal:1500,0.6,4096")
    assert (d.kind, d.a, d.b, d.cap, d.max) == ("lognormal", 1500, 0.6, 4096, 4096)
    for text in ("fixed:12", "uniform:3,9", "lognormal:1500,0.6,4096"):
        assert str(LengthDist.parse(text)) == text


@pytest.mark.parametrize(
    "text",
    [
        "fixed:0",
        "fixed:1.5",
        "uniform:9,3",
        "uniform:0,3",
        "lognormal:100,0.5",
        "lognormal:100,-1,200",
        "zipf:1",
        "fixed:x",
        "lognormal:5000,0.1,100",
    ],  # fmt: skip
)
def test_parse_rejects(text):
    with pytest.raises(ValueError, match="length distribution"):
        LengthDist.parse(text)


def test_fixed_and_uniform_samples():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("fixed:7").sample(rng, 5).tolist() == [7] * 5
    x = LengthDist.parse("uniform:3,6").sample(rng, 4000)
    assert set(x.tolist()) == {3, 4, 5, 6}  # both ends inclusive
    assert abs(x.mean() - 4.5) < 0.1


def test_lognormal_mean_is_the_arithmetic_mean():
    x = LengthDist.parse("lognormal:1500,0.6,1000000").sample(np.random.default_rng(1), 200_000)
    assert abs(x.mean() / 1500 - 1) < 0.01
    assert abs(np.log(x).std() - 0.6) < 0.01
    sigma0 = LengthDist.parse("lognormal:256,0,512").sample(np.random.default_rng(1), 10)
    assert sigma0.tolist() == [256] * 10


def test_lognormal_truncation_redraws_instead_of_piling_at_max():
    d = LengthDist.parse("lognormal:1500,0.6,4096")
    x = d.sample(np.random.default_rng(2), 100_000)
    assert x.min() >= 1 and x.max() <= 4096
    # ~2.4% of the untruncated law lies above 4096: clipping would put them all at 4096
    assert (x == 4096).sum() < 50
    raw = np.rint(np.random.default_rng(3).lognormal(math.log(1500) - 0.18, 0.6, 100_000))
    assert abs(d.accept_probability() - (raw <= 4096).mean()) < 0.003
    kept = 0.5 * (1 + math.erf((math.log(4096.5) - (math.log(1500) - 0.18)) / (0.6 * math.sqrt(2))))
    assert abs(d.accept_probability() - kept) < 1e-3


def test_poisson_arrivals():
    t = poisson_arrivals(5.0, np.random.default_rng(0), n=20_000)
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    assert abs(np.diff(t).mean() - 0.2) < 0.005
    assert abs(np.diff(t).std() - 0.2) < 0.01  # exponential gaps: std = mean
    d = poisson_arrivals(50.0, np.random.default_rng(0), duration_s=40.0)
    assert d.max() < 40.0 and abs(len(d) - 2000) < 150
    assert poisson_arrivals(math.inf, np.random.default_rng(0), n=3).tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        poisson_arrivals(0, np.random.default_rng(0), n=3)
    with pytest.raises(ValueError):
        poisson_arrivals(math.inf, np.random.default_rng(0), duration_s=3)


def test_open_loop_specs_are_reproducible():
    a = open_loop_specs(2.0, LengthDist.parse("uniform:5,50"), LengthDist.parse("fixed:9"), 3, 50, None)
    b = open_loop_specs(2.0, LengthDist.parse("uniform:5,50"), LengthDist.parse("fixed:9"), 3, 50, None)
    c = open_loop_specs(2.0, LengthDist.parse("uniform:5,50"), LengthDist.parse("fixed:9"), 4, 50, None)
    assert a == b and a != c
    assert [s.index for s in a] == list(range(50)) and all(s.output_tokens == 9 for s in a)


def test_spec_stream_limit_endless_and_pickle():
    s = SpecStream(LengthDist.parse("uniform:1,100"), LengthDist.parse("fixed:3"), 0, 2500)
    specs = list(s)
    assert [x.index for x in specs] == list(range(2500)) and all(x.arrival_s is None for x in specs)
    assert list(pickle.loads(pickle.dumps(s))) == specs
    endless = iter(SpecStream(LengthDist.parse("uniform:1,100"), LengthDist.parse("fixed:3"), 0))
    first = [next(endless) for _ in range(2500)]
    assert first == specs  # the same draws, only not cut off


def test_load_trace_formats_sorting_and_errors(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(
        '{"arrival_s": 5.5, "input_tokens": 10, "output_tokens": 3}\n\n'
        '{"arrival_s": 2.0, "input_tokens": 20, "output_tokens": 4}\n'
        '{"timestamp": 3000, "input_length": 30, "output_length": 5, "hash_ids": [1, 2]}\n'
    )
    specs = load_trace(f)
    assert [(s.index, s.arrival_s, s.input_tokens, s.output_tokens) for s in specs] == [
        (0, 0.0, 20, 4),
        (1, 1.0, 30, 5),
        (2, 3.5, 10, 3),
    ]
    for bad in ('{"arrival_s": 1, "input_tokens": 0, "output_tokens": 3}', '{"x": 1}', "not json", "[1, 2]"):
        f.write_text('{"arrival_s": 0, "input_tokens": 1, "output_tokens": 1}\n' + bad + "\n")
        with pytest.raises(ValueError, match=r"t\.jsonl:2"):
            load_trace(f)
    f.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(f)


def test_vocabulary_from_model_dir_leaves_special_tokens_out(tmp_path):
    from pdserve.models.checkpoints import SPECIAL_TOKENS, build_tokenizer

    build_tokenizer(tmp_path, vocab_size=300)
    v = Vocabulary.from_model_dir(tmp_path)
    assert v.max_model_len is None and len(v.ids) == 300 - len(SPECIAL_TOKENS)
    assert not set(v.ids.tolist()) & set(range(len(SPECIAL_TOKENS)))  # the specials are ids 0..4
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 200, "max_position_embeddings": 1024}))
    v = Vocabulary.from_model_dir(tmp_path)
    assert v.max_model_len == 1024 and v.ids.max() == 199  # the model's vocab_size bounds the ids
    with pytest.raises(ValueError, match="tokenizer.json"):
        Vocabulary.from_model_dir(tmp_path / "nothing")


def test_prompts_are_exact_fresh_and_reproducible():
    vocab = Vocabulary.from_size(1000, first_id=5)
    p = PromptMaker(vocab, nonce=42)
    prompts = [p.make(i, 40) for i in range(3000)]
    assert all(len(x) == 40 and min(x) >= 5 and max(x) < 1000 for x in prompts)
    assert len({tuple(x[:2]) for x in prompts}) == 3000  # no two share a first page
    assert p.make(7, 40) == prompts[7] and p.make(7, 1) == prompts[7][:1]
    other_run, other_nonce = p.for_run(1).make(7, 40), PromptMaker(vocab, 43).make(7, 40)
    assert other_run[2:] != prompts[7][2:] and other_nonce[2:] != prompts[7][2:]
    assert PromptMaker.fresh(vocab).nonce != PromptMaker.fresh(vocab).nonce
    assert PromptMaker.fresh(vocab, 9).nonce == 9
    with pytest.raises(ValueError):
        Vocabulary.from_size(1)
