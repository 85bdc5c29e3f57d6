"""Structured output in the engine (xgrammar): JSON schema, any JSON object, regex, choice and EBNF outputs of the
random-weight tiny model follow their spec; the grammar state survives a failover resume; bad specs are refused."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from engine_testutil import random_prompt, run_to_completion

from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.structured_spec import StructuredSpec
from pdserve.errors import InvalidRequest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{0,3}$"}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"


def run(engine, spec: StructuredSpec, n: int, max_tokens: int = 120, **kw) -> list[dict]:
    for i in range(n):
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured=spec, **kw)
        engine.add_request(EngineRequest(f"s{i}", random_prompt(6, seed=i), sp))
    res = run_to_completion(engine)
    return [res[f"s{i}"] for i in range(n)]


def test_json_schema(llama_engine):
    for r in run(llama_engine, StructuredSpec("json_schema", json.dumps(SCHEMA)), 6):
        assert r["outputs"][-1].finish_reason == "stop", r["text"]
        jsonschema.validate(json.loads(r["text"]), SCHEMA)


def test_json_object_regex_choice_grammar(llama_engine):
    for r in run(llama_engine, StructuredSpec("json_object"), 3, max_tokens=200):
        if r["outputs"][-1].finish_reason == "stop":  # an open object may run past max_tokens
            assert isinstance(json.loads(r["text"]), dict)
    for r in run(llama_engine, StructuredSpec("regex", REGEX), 4):
        assert re.fullmatch(REGEX, r["text"]), r["text"]
    choices = ("yes", "no", 'say "maybe"')
    for r in run(llama_engine, StructuredSpec("choice", choices=choices), 4):
        assert r["text"] in choices
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    for r in run(llama_engine, StructuredSpec("grammar", grammar), 3, max_tokens=60):
        if r["outputs"][-1].finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", r["text"]), r["text"]


def test_resume_replays_generated_tokens(llama_engine):
    """A resumed request (the prompt ends with tokens generated before) continues the same structured output: the
    whole text still matches, and a resume whose tokens break the grammar is refused."""
    spec = StructuredSpec("regex", REGEX)
    prompt = random_prompt(6, seed=11)
    sp = SamplingParams(max_tokens=40, temperature=0, structured=spec)
    llama_engine.add_request(EngineRequest("whole", prompt, sp))
    whole = run_to_completion(llama_engine)["whole"]["tokens"]
    k = 2
    llama_engine.add_request(EngineRequest("resumed", prompt + whole[:k], sp, resumed_tokens=k))
    rest = run_to_completion(llama_engine)["resumed"]["tokens"]
    assert whole[:k] + rest == whole
    # the prefill side of a disaggregated resume: the prompt's last k tokens were sampled before (sampled_before)
    ask = EngineRequest("pre", prompt + whole[:k], sp, prefill_only=True, sampled_before=k)
    llama_engine.add_request(ask)
    first = run_to_completion(llama_engine)["pre"]["tokens"]
    llama_engine.release("pre")
    assert first == [whole[k]]
    bad = llama_engine.tokenizer.encode("@@")
    with pytest.raises(InvalidRequest, match="structured output"):
        llama_engine.add_request(EngineRequest("bad", prompt + bad, sp, resumed_tokens=len(bad)))
    assert "bad" not in llama_engine.request_ids()


@pytest.mark.parametrize(
    "spec, reason",
    [
        (StructuredSpec("regex", "[a-"), "does not compile"),
        (StructuredSpec("grammar", "root ::= "), "does not compile"),
        (StructuredSpec("json_schema", "{not json"), "not valid JSON"),
        (StructuredSpec("json_schema", '{"type": "nonsense"}'), "does not compile"),
        (StructuredSpec("choice", choices=()), "choice"),
        (StructuredSpec("yaml", "x"), "kind"),
    ],
)
def test_bad_specs_refused(llama_engine, spec, reason):
    with pytest.raises(InvalidRequest, match=reason):
        llama_engine.add_request(EngineRequest("bad", [5, 6], SamplingParams(max_tokens=4, structured=spec)))
    assert "bad" not in llama_engine.request_ids()
