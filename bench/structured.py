"""Structured output's cost (issue 34 item 1): the grammar masks of a batch filled on the host, and the decode
inter-token latency of a batch of 32 JSON-schema requests against 32 plain ones (docs/bench/structured.json).

    python bench/structured.py --part cpu-fill [--batch 32] [--steps 60]
    python bench/structured.py --part structured [--json docs/bench/structured.json]   # one GPU, < 4 min
    python bench/structured.py --part choices [--json docs/bench/structured.json]      # one GPU, ~6 min
    python bench/structured.py --part choices,structured --json docs/bench/structured.json  # both keys' sets

Tokenizer: a byte-level BPE with Llama-3's vocabulary size (128,256 tokens), so that a mask is as wide and the
grammar's token checks as many as with a real model's: the shipped corpus's own BPE merges, then merges of a word
piece and a continuation (2% of them a punctuation piece, as a large vocabulary's share) until the size is reached.

cpu-fill: ms to fill one step's masks of `--batch` sequences, each a matcher of SCHEMA advanced by random allowed
tokens (what a random-weight model draws), one matcher after the other against xgrammar's multi-threaded batch fill.

structured (GPU): Llama-3-8B-shaped random weights (load_format dummy), int8 KV, bf16, FA3, decode CUDA graphs,
overlapped decode; 32 greedy requests of 256-token prompts decode, plain (ignore_eos) and then with SCHEMA; the ITL
is the median wall time of an engine step over `--tokens` steps after 16 warm-up steps, while all 32 run (the
time between two tokens of a request). The schema compiles once in a warm-up batch first (xgrammar caches it).

choices (GPU, issue 34 item 3): bench/gpu_serving.py's `choices` part (router, prefill and decode processes on this
GPU, 8B random bf16 checkpoint written once under `--workdir`): 8 fresh 2048-token prompts at once, 4 completions
of 128 tokens each, as n = 4 (`n4_out_tok_s`) and as four separate requests (`n1x4_out_tok_s`), target >= 1.5x.
It runs before `structured` when both are asked for: its processes are gone (their memory with them) before the
in-process engine loads. Parts merge into `--json` (each part's provenance under `<part>_run`), so they may also
run in separate calls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchutil import Table, log, merge_json, provenance

LLAMA3_VOCAB = 128256
PROMPT_TOKENS = 256
PUNCTUATION_SHARE = 0.02  # synthetic tokens ending in punctuation (Llama-3: ~2% of its tokens hold a '"')
SCHEMA = {  # a record as an API asks for it; its free-text "note" last: most of an output's tokens are free text
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-f0-9]{8}-[a-f0-9]{4}$"},
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}( [A-Z][a-z]{1,11})?$"},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{2,8}\\.(com|org|net)$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "pattern": "^[0-9]{1,4} [A-Za-z ]{2,24}$"},
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "note": {"type": "string"},
    },
    "required": ["id", "name", "email", "age", "role", "active", "score", "tags", "address", "note"],
    "additionalProperties": False,
}


def _ascii(s: str) -> str:
    """`s` if it is printable ASCII, else "" (byte-level BPE writes control and non-ASCII bytes as other chars)."""
    return s if s.isascii() else ""


def build_wide_tokenizer(out: Path, vocab_size: int = LLAMA3_VOCAB, seed: int = 0) -> None:
    """A byte-level BPE tokenizer of `vocab_size` tokens in `out` (HF files): the shipped corpus's merges, then
    synthetic merges of a token and a continuation piece (no leading space) until the size is reached."""
    from pdserve.models.checkpoints import build_tokenizer

    build_tokenizer(out, vocab_size=4096)
    path = out / "tokenizer.json"
    doc = json.loads(path.read_text())
    model = doc["model"]
    vocab: dict[str, int] = model["vocab"]
    merges: list[Any] = model["merges"]
    pair_as_list = bool(merges) and isinstance(merges[0], list)
    specials = len(doc.get("added_tokens", []))
    tokens = sorted(vocab, key=vocab.get)  # type: ignore[arg-type]
    words = [t for t in tokens if _ascii(t.lstrip("Ġ")).isalnum()]  # word pieces, with or without a leading space
    pieces = [t for t in words if not t.startswith("Ġ")] or words  # continuations
    marks = [t for t in tokens if _ascii(t.lstrip("Ġ")).isprintable() and t not in words]  # punctuation, code
    rng = random.Random(seed)
    next_id = max(vocab.values()) + 1
    target = vocab_size - max(0, specials - (next_id - len(vocab)))
    while len(vocab) < target:
        a = rng.choice(words)
        b = rng.choice(marks) if rng.random() < PUNCTUATION_SHARE else rng.choice(pieces)
        if len(a) + len(b) > 16 or a + b in vocab:
            continue
        vocab[a + b] = next_id
        merges.append([a, b] if pair_as_list else f"{a} {b}")
        if b in pieces:
            words.append(a + b)
            if not a.startswith("Ġ"):
                pieces.append(a + b)
        next_id += 1
    path.write_text(json.dumps(doc, ensure_ascii=False))


def advanced_states(compiler: Any, vocab: int, batch: int, steps: int, seed: int = 0):
    """Yield, `steps` times, `batch` matchers of SCHEMA in the states of random allowed-token walks."""
    import torch
    import xgrammar as xgr

    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    rng = torch.Generator().manual_seed(seed)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgr.allocate_token_bitmask(batch, vocab)
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(steps):
        yield matchers
        mask.fill_(-1)
        for i, m in enumerate(matchers):
            if m.is_terminated():
                matchers[i] = m = xgr.GrammarMatcher(compiled)
            m.fill_next_token_bitmask(mask, i)
        allowed = ((mask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [B, V]
        for i, m in enumerate(matchers):
            ids = allowed[i].nonzero().flatten()
            m.accept_token(int(ids[torch.randint(len(ids), (1,), generator=rng)]))


def cpu_fill(table: Table, batch: int, steps: int) -> dict[str, float]:
    """Median / p90 ms of one step's mask fill of `batch` sequences: serial, then the batch matcher's threads."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        build_wide_tokenizer(Path(d))
        tok = AutoTokenizer.from_pretrained(d)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=LLAMA3_VOCAB, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    mask = xgr.allocate_token_bitmask(batch, LLAMA3_VOCAB)
    threads = sorted({1, 2, 4, 8} & set(range(1, (os.cpu_count() or 1) + 1)))
    batchers = {n: xgr.BatchGrammarMatcher(max_threads=n) for n in threads}
    times: dict[str, list[float]] = {"serial": [], **{f"batch_t{n}": [] for n in threads}}
    for matchers in advanced_states(compiler, LLAMA3_VOCAB, batch, steps):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        times["serial"].append((time.perf_counter() - t0) * 1e3)
        for n, bm in batchers.items():
            t0 = time.perf_counter()
            bm.batch_fill_next_token_bitmask(matchers, mask)
            times[f"batch_t{n}"].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for name, ts in times.items():
        ts = sorted(ts)
        out[f"fill_ms_b{batch}_{name}"] = round(statistics.median(ts), 3)
        out[f"fill_ms_b{batch}_{name}_p90"] = round(ts[int(0.9 * (len(ts) - 1))], 3)
        table.row(f"fill b{batch} {name}", f"{statistics.median(ts):.3f} ms", f"p90 {ts[int(0.9 * (len(ts) - 1))]:.3f}")
    return out


# ---- GPU: decode ITL at batch 32, plain against json_schema ------------------------------------------------------
def decode_itl_ms(e: Any, batch: int, sp: Any, warmup: int, steps: int, seed: int) -> tuple[float, int]:
    """Median wall ms of an engine step while `batch` requests of `sp` decode (after `warmup` steps), over at most
    `steps` steps and only while all of them run; returns (ms, steps timed)."""
    import torch
    from benchutil import submit

    g = torch.Generator().manual_seed(seed)
    rids = [f"b{seed}-{i}" for i in range(batch)]
    for rid in rids:
        submit(e, rid, torch.randint(5, 4000, (PROMPT_TOKENS,), generator=g).tolist(), sp)
    while len(e.scheduler.running) < batch or e.scheduler.waiting:
        e.step()
    for _ in range(warmup):
        e.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = e.step()
        times.append((time.perf_counter() - t0) * 1e3)
        if any(o.finished for o in outs) or len(e.scheduler.running) < batch:
            break
    for rid in rids:
        e.abort(rid)
    while e.has_unfinished_requests():
        e.step()
    return statistics.median(times), len(times)


def itl_section(table: Table, batch: int, tokens: int, mask_threads: int = 0) -> dict[str, Any]:
    """The 8B engine (dummy weights, int8 KV, graphs, overlapped decode): ITL at `batch`, plain then json_schema."""
    import gpu_engine as ge
    import torch
    from fp8_weights import write_config_dir

    from pdserve.engine import structured
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.structured_spec import StructuredSpec
    from pdserve.models.random_llama import LLAMA3_8B_SHAPE

    # kept until the process exits: the engine reads the tokenizer files again at its first structured request
    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(tmp.name)
    t0 = time.perf_counter()
    build_wide_tokenizer(model_dir)
    write_config_dir(model_dir, LLAMA3_8B_SHAPE, 32, None)
    log(f"model dir (config + {LLAMA3_VOCAB}-token tokenizer) in {time.perf_counter() - t0:.1f}s")
    e = ge.make_engine(model_dir, "int8", num_pages=8192, load_format="dummy")
    assert e.overlap_decode, "overlapped decode is off"
    fills: list[float] = []
    fill = structured.fill_bitmasks

    def timed_fill(states, bitmask) -> None:  # the worker thread's time per step
        t = time.perf_counter()
        fill(states, bitmask)
        fills.append((time.perf_counter() - t) * 1e3)

    structured.fill_bitmasks = timed_fill  # type: ignore[assignment]
    if mask_threads:
        structured.MAX_MASK_THREADS = mask_threads  # read when the first structured request builds the compiler
    plain = SamplingParams(max_tokens=tokens + 64, temperature=0.0, ignore_eos=True)
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    constrained = SamplingParams(max_tokens=tokens + 64, temperature=0.0, structured=spec)
    decode_itl_ms(e, batch, constrained, 4, 8, seed=99)  # compiles the schema, warms the grammar caches
    fills.clear()
    res: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    for name, sp in (("plain", plain), ("json_schema", constrained), ("json_schema_not_overlapped", constrained)):
        e._overlap = name != "json_schema_not_overlapped"  # the latter: masks filled and applied between steps
        ms, n = decode_itl_ms(e, batch, sp, 16, tokens, seed=1)
        res[f"itl_ms_b{batch}_{name}"] = round(ms, 3)
        res[f"itl_steps_b{batch}_{name}"] = n
        table.row(f"ITL b{batch} {name}", f"{ms:.2f} ms", f"median of {n} steps")
        if name == "json_schema":
            res[f"mask_fill_ms_b{batch}"] = round(statistics.median(fills), 3) if fills else None
    ratio = res[f"itl_ms_b{batch}_json_schema"] / res[f"itl_ms_b{batch}_plain"]
    res["json_schema_over_plain"] = round(ratio, 3)
    res["setup"] = (
        f"Llama-3-8B shape, random bf16 weights (dummy), int8 KV, FA3, decode graphs, overlapped decode; "
        f"{batch} greedy requests of {PROMPT_TOKENS}-token prompts; {LLAMA3_VOCAB}-token byte-level BPE; schema: "
        f"bench/structured.py SCHEMA (pattern / maxLength strings, enum, integer, number, boolean, array, object, "
        f"then a free-text string); "
        f"mask fill on the worker thread with {structured.MAX_MASK_THREADS} xgrammar threads at most (half the "
        f"cores); json_schema_not_overlapped: overlapped decode off (masks filled and applied between steps)"
    )
    table.row("json_schema / plain", f"{ratio:.3f}", "target <= 1.1")
    table.row(f"mask fill b{batch}", f"{res[f'mask_fill_ms_b{batch}']} ms", "median, worker thread, beside the forward")
    return res


# ---- GPU: n = 4 against four separate requests, served -------------------------------------------------------
def choices_section(table: Table, workdir: Path, layers: int = 32) -> dict[str, Any]:
    """bench/gpu_serving.py's `choices` figures on a stack of this GPU (its 8B checkpoint written once in `workdir`)."""
    import gpu_serving as gs
    import torch

    from pdserve.models.random_llama import write_random_llama

    model = workdir / f"llama8b-{layers}l"
    if not (model / "model.safetensors.index.json").exists():
        t0 = time.perf_counter()
        write_random_llama(model, layers, device="cuda:0")
        log(f"random 8B checkpoint written in {time.perf_counter() - t0:.1f}s")
    stack = gs.start(model, workdir / "choices", "auto", {})
    try:
        got = gs.choices_figures(stack, torch.Generator().manual_seed(int(time.time())))
    finally:
        stack.stop()
    table.row("n=4 / 4 x n=1 output", f"{got['n4_out_tok_s']:.0f} / {got['n1x4_out_tok_s']:.0f} tok/s",
              f"{got['n4_speedup']:.2f}x, target >= 1.5")  # fmt: skip
    return {"device": torch.cuda.get_device_name(), **got}


PARTS = ("cpu-fill", "choices", "structured")  # the order they run in


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", required=True, help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=96, help="decode tokens per request (structured part)")
    ap.add_argument("--mask-threads", type=int, default=0, help="xgrammar threads (0: the engine's default)")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pdserve-gpu-serving"), help="choices")
    ap.add_argument("--commit", default="", help="commit measured (a device copy of the tree may lack git)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    parts = args.part.split(",")
    if not parts or any(p not in PARTS for p in parts):
        ap.error(f"--part: comma-separated names of {', '.join(PARTS)}, got {args.part!r}")
    for part in (p for p in PARTS if p in parts):
        table = Table()
        if part == "cpu-fill":
            res = cpu_fill(table, args.batch, args.steps)
        elif part == "choices":
            res = choices_section(table, Path(args.workdir))
        else:
            res = itl_section(table, args.batch, args.tokens, args.mask_threads)
        table.print()
        if args.json:
            run = provenance(args.commit, device=res.pop("device", ""))
            merge_json(args.json, {**run, **res, f"{part}_run": run})
        else:
            json.dump(res, sys.stdout, indent=1)
            print()


if __name__ == "__main__":
    main()
