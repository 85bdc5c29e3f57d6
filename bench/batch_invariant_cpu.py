"""`--batch-invariant`'s price in decode throughput on CPU, and how many concurrent greedy streams differ from the same
prompts run one at a time in each mode (issue 35 item 5's rule: the default only where it costs <= 5%).

    python bench/batch_invariant_cpu.py [--batches 1,8,16] [--layers 4] [--json out.json]

A random llama of SmolLM2-135M's widths (hidden 576, 9 heads / 3 KV heads of 64, MLP 1536; `--layers` layers, vocab
2048), float32, int8 KV, 2 torch threads (as the services run). Per batch size B (the engine's max_num_seqs): B greedy
requests of `--prompt` random tokens, `--tokens` tokens each; decode tokens per second over the steps after every
prompt is in (prefill excluded), best of `--rounds` rounds with the two modes in turns. The GPU figure is
`python bench/kv_formats.py --batch-invariant` (decode step at b64 / b128, 8B shape, H200).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from benchutil import provenance

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.request import EngineRequest
from pdserve.engine.sampling import SamplingParams
from pdserve.models.checkpoints import build_checkpoint

WIDE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(35)
    return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(n)]


def engine(model: Path, batch: int, invariant: bool, kv: str) -> LLMEngine:
    cfg = EngineConfig(model_dir=str(model), device="cpu", dtype="float32", page_size=16, chunk_size=2048,
                       num_pages=4096, max_num_seqs=batch, kv_dtype=kv, batch_invariant=invariant)  # fmt: skip
    return LLMEngine(cfg)


def decode_rate(e: LLMEngine, ps: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s once every prompt is in (steps that produce one token per live request), and the outputs."""
    sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    for i, p in enumerate(ps):
        e.add_request(EngineRequest(f"r{i}", p, sp))
    t0, n0, live = None, 0, set(outs)
    while live:
        step = e.step()
        for o in step:
            outs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                live.discard(o.request_id)
        if t0 is None and all(outs[r] for r in outs):  # every prompt prefilled: decode from here
            t0, n0 = time.perf_counter(), sum(map(len, outs.values()))
    assert t0 is not None
    return (sum(map(len, outs.values())) - n0) / (time.perf_counter() - t0), list(outs.values())


def differing(model: Path, invariant: bool, kv: str, ps: list[list[int]], tokens: int) -> int:
    """Greedy streams of `ps` run together that differ from each prompt run alone."""
    together = decode_rate(engine(model, len(ps), invariant, kv), ps, tokens)[1]
    alone_engine = engine(model, len(ps), invariant, kv)
    alone = [decode_rate(alone_engine, [p], tokens)[1][0] for p in ps]
    return sum(a != b for a, b in zip(together, alone))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv", default="int8")
    ap.add_argument("--streams", type=int, default=16, help="the differing-streams count (0: skip it)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    torch.set_num_threads(2)
    vocab = 2048
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(Path(tmp), arch="llama", seed=3, num_hidden_layers=args.layers, vocab_size=vocab,
                                 **WIDE)  # fmt: skip
        rows: dict = {}
        for b in (int(x) for x in args.batches.split(",")):
            ps = prompts(b, args.prompt, vocab)
            engines = {mode: engine(model, b, mode == "on", args.kv) for mode in ("off", "on")}
            best = {mode: 0.0 for mode in engines}
            for _ in range(args.rounds):
                for mode, e in engines.items():
                    best[mode] = max(best[mode], decode_rate(e, ps, args.tokens)[0])
            rows[f"b{b}"] = dict(off_tok_s=round(best["off"], 1), on_tok_s=round(best["on"], 1),
                                 cost=round(best["off"] / best["on"], 3))  # fmt: skip
            print(f"b{b}: {rows[f'b{b}']}", flush=True)
        doc = dict(rows=rows, model=f"llama SmolLM2-135M widths, {args.layers} layers, fp32", kv=args.kv,
                   prompt=args.prompt, tokens=args.tokens, **provenance(args.commit))  # fmt: skip
        if args.streams:
            ps = prompts(args.streams, args.prompt, vocab)
            doc["differing_streams"] = {m: differing(model, m == "on", args.kv, ps, args.tokens) for m in ("off", "on")}
            doc["streams"] = args.streams
            print(f"differing streams of {args.streams}: {doc['differing_streams']}", flush=True)
    print(json.dumps(doc))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
