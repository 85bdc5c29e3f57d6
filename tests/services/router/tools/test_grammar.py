"""The grammar of an enforced tool choice, compiled by the engine's xgrammar compiler for the tiny tokenizer: a
random walk over its token masks (any token the mask allows, as a random-weight model may pick) always ends in
output the format's parser reads as calls of the allowed tools, with arguments valid against their parameters."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar as xgr

from pdserve.engine.structured import StructuredCompiler
from pdserve.engine.structured_spec import StructuredSpec
from pdserve.models.checkpoints import build_tokenizer
from pdserve.router.tools.formats import FORMATS
from pdserve.router.tools.grammar import call_structural_tag
from pdserve.router.tools.parsers import parse_calls
from pdserve.router.tools.toolset import NAMED, REQUIRED, Tool, ToolSet

VOCAB, EOS = 512, 2
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = (Tool("get_weather", "Weather", WEATHER), Tool("get_time", "", TIME))
WALKS = 12
MAX_STEPS = 1200


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, vocab_size=VOCAB)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return StructuredCompiler(tokenizer, VOCAB, [EOS])


def _walk(compiler, tag: str, tokenizer, rng: random.Random) -> str:
    """Token by token, a uniformly random token the mask allows, until the grammar ends (EOS allowed)."""
    matcher = xgr.GrammarMatcher(compiler.compile(StructuredSpec("structural_tag", tag)))
    mask = xgr.allocate_token_bitmask(1, VOCAB)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        if matcher.is_terminated():
            return tokenizer.decode(ids, skip_special_tokens=True)
        matcher.fill_next_token_bitmask(mask)
        row = mask[0].tolist()
        allowed = [t for t in range(VOCAB) if (row[t // 32] >> (t % 32)) & 1]
        t = rng.choice(allowed)
        assert matcher.accept_token(t)
        ids.append(t)
    raise AssertionError(f"no end after {MAX_STEPS} tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("mode", [NAMED, REQUIRED])
def test_random_walks_parse_to_valid_calls(compiler, tokenizer, fmt_name, mode):
    fmt = FORMATS[fmt_name]
    tools = ToolSet(TOOLS, mode, "get_weather" if mode == NAMED else "", parallel=mode == REQUIRED)
    tag = call_structural_tag(fmt, tools)
    StructuredSpec("structural_tag", tag).validate()
    rng = random.Random(f"{fmt_name}-{mode}")
    schemas = {t.name: t.parameters for t in TOOLS}
    counts = []
    for _ in range(WALKS):
        output = _walk(compiler, tag, tokenizer, rng)
        content, calls = parse_calls(fmt, output)
        assert content == "" and calls, output
        if mode == NAMED:
            assert [c.name for c in calls] == ["get_weather"], output
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        counts.append(len(calls))
    if mode == REQUIRED:
        assert max(counts) > 1  # parallel calls allowed: some walk made several


def test_one_call_without_parallel_calls(compiler, tokenizer):
    tools = ToolSet(TOOLS, REQUIRED, parallel=False)
    tag = call_structural_tag(FORMATS["hermes"], tools)
    rng = random.Random(5)
    for _ in range(WALKS):
        _, calls = parse_calls(FORMATS["hermes"], _walk(compiler, tag, tokenizer, rng))
        assert len(calls) == 1


def test_bad_structural_tags_are_refused(compiler):
    from pdserve.errors import InvalidRequest

    for value, words in [("{", "not valid JSON"), ('{"type": "x"}', "structural_tag")]:
        with pytest.raises(InvalidRequest, match=words):
            StructuredSpec("structural_tag", value).validate()
    bad = json.dumps({"type": "structural_tag", "format": {"type": "nope"}})
    with pytest.raises(InvalidRequest, match="does not compile"):
        compiler.compile(StructuredSpec("structural_tag", bad))
