"""Structured output in overlapped decode (issue 34 item 1): greedy structured requests chain their steps; each
step's grammar masks are filled on the mask worker thread (started before the draw needs them) and the draw
among the allowed tokens gives exactly the serial path's tokens; the masked draw's ops equal the sampler's mask;
a failover resume replays its tokens into the matcher the overlapped draw reads. On CPU a launch computes at once
(the bookkeeping and the mask ops are the GPU path's; the decode graph's masked draw is the GPU test below)."""

from __future__ import annotations

import json

import pytest
import torch
from engine_testutil import random_prompt, run_to_completion

from pdserve.engine import structured
from pdserve.engine.logits_processors import allowed_tokens, apply_bitmask, masked_logits
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.structured import MaskFiller, StructuredCompiler
from pdserve.engine.structured_spec import StructuredSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"


def _requests(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy rows with and without a grammar in one batch, ending at different steps."""
    specs = [StructuredSpec("json_schema", json.dumps(SCHEMA)), StructuredSpec("regex", REGEX), None]
    out = []
    for i in range(6):
        sp = SamplingParams(max_tokens=10 + 7 * (i % 3), temperature=0.0, structured=specs[i % 3], ignore_eos=i == 2)
        out.append((f"r{i}", random_prompt(3 + i, seed=70 + i, vocab=vocab), sp))
    return out


def _run(engine, reqs) -> dict:
    for rid, prompt, sp in reqs:
        engine.add_request(EngineRequest(rid, prompt, sp))
    return {
        rid: (r["tokens"], r["text"], r["outputs"][-1].finish_reason) for rid, r in run_to_completion(engine).items()
    }


def test_overlapped_masked_draw_gives_the_serial_tokens(make_engine, monkeypatch):
    plain = make_engine(chunk_size=64)  # every prompt in one prefill step: the rows decode as one batch
    reqs = _requests(plain.model_config.vocab_size)
    want = _run(plain, reqs)
    eng = make_engine(chunk_size=64, overlap_decode="on")
    seen = {"chained": 0, "finished": 0, "started_before": 0}
    launch, finish = eng.runner.launch_decode, structured.MaskedDraw.finish

    def counted_launch(seqs, positions, prev):
        seen["chained"] += prev is not None
        return launch(seqs, positions, prev)

    def checked_finish(self):
        seen["finished"] += 1
        seen["started_before"] += self._future is not None  # the fill ran beside the forward, not on demand
        return finish(self)

    eng.runner.launch_decode = counted_launch  # type: ignore[method-assign]
    monkeypatch.setattr(structured.MaskedDraw, "finish", checked_finish)
    assert _run(eng, reqs) == want
    assert seen["chained"] > 5 and seen["finished"] > 5
    assert seen["started_before"] == seen["finished"]
    assert any(r[2] == "stop" for r in want.values())  # some structured outputs completed (the grammar's EOS)
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_resume_replays_into_the_overlapped_draw(make_engine):
    """A failover resume (the prompt ends with the tokens generated before) continues the same structured output
    through overlapped steps: the whole output is the uninterrupted one's."""
    eng = make_engine(overlap_decode="on")
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    prompt = random_prompt(6, seed=12)
    sp = SamplingParams(max_tokens=40, temperature=0.0, structured=spec)
    eng.add_request(EngineRequest("whole", prompt, sp))
    whole = run_to_completion(eng)["whole"]["tokens"]
    assert len(whole) > 4
    for k in (1, 4):
        eng.add_request(EngineRequest(f"resumed{k}", prompt + whole[:k], sp, resumed_tokens=k))
        rest = run_to_completion(eng)[f"resumed{k}"]["tokens"]
        assert whole[:k] + rest == whole


def test_masked_logits_equal_the_sampler_mask():
    g = torch.Generator().manual_seed(3)
    vocab = 1000  # not a multiple of 32: the last word's high bits are past the vocabulary
    logits = torch.randn((5, vocab), generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    bitmask[1] = -1  # a row without a grammar: all allowed
    bitmask[2, :] = 0
    bitmask[2, 30] = 1 << 8  # one allowed token: 30 * 32 + 8
    want = apply_bitmask(logits.clone(), bitmask)
    got = masked_logits(logits, bitmask)
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1]) and int(got[2].argmax()) == 30 * 32 + 8
    token = 7 * 32 + 31  # bit 31: the word's sign bit
    one = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    one[0, 7] = -(2**31)
    assert allowed_tokens(one, vocab)[0].nonzero().flatten().tolist() == [token]


def test_mask_filler_rows_match_the_serial_fill(llama_engine):
    """The worker's rows: each sequence's mask as its own matcher fills it (and the JSON control-token ban), all
    ones without a grammar; the two buffers alternate, so a result stays valid while the next is filled."""
    mc = llama_engine.model_config
    compiler = StructuredCompiler(llama_engine.tokenizer, mc.vocab_size, mc.eos_token_ids)
    a = compiler.matcher(StructuredSpec("json_schema", json.dumps(SCHEMA)))
    b = compiler.matcher(StructuredSpec("regex", REGEX))
    for t in llama_engine.tokenizer.encode('{"name'):  # somewhere inside the object
        assert a.accept(t)
    filler = MaskFiller(4, mc.vocab_size, pin=False)
    try:
        first = filler.start([a, None, b]).result()
        second = filler.start([b]).result()
        words = (mc.vocab_size + 31) // 32
        serial = torch.full((3, words), -1, dtype=torch.int32)
        a._matcher.fill_next_token_bitmask(serial, 0)
        b._matcher.fill_next_token_bitmask(serial, 2)
        serial[0] &= compiler._json_allowed
        assert first.shape == (3, words) and torch.equal(first, serial)
        assert torch.equal(second[0], serial[2])
        assert (first[1] == -1).all() and not torch.equal(first[0], first[2])
    finally:
        filler.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode graph's masked draw needs CUDA")
def test_decode_graph_masked_draw_gives_the_serial_tokens(make_engine):
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="auto", page_size=16, chunk_size=64, num_pages=96)
    plain = make_engine("llama_hd64", **kw, max_num_seqs=8, overlap_decode="off")  # graphs, masks on the host
    reqs = _requests(plain.model_config.vocab_size)
    want = _run(plain, reqs)
    eng = make_engine("llama_hd64", **kw, max_num_seqs=8, overlap_decode="on")
    if eng.runner.graph_runner is None:
        pytest.skip("no decode CUDA graphs on this device")
    assert _run(eng, reqs) == want


def test_only_a_grammar_keeps_the_draw_on_the_device():
    spec = StructuredSpec("regex", REGEX)
    assert not SamplingParams(structured=spec, min_tokens=3).needs_host_logits  # the grammar decides the end
    assert SamplingParams(structured=spec, logit_bias={5: 1.0}).needs_host_logits
    assert SamplingParams(structured=spec, presence_penalty=0.5).needs_host_logits
    assert SamplingParams(min_tokens=3).needs_host_logits and not SamplingParams().needs_host_logits
