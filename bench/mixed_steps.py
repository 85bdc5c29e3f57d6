"""Mixed steps on one GPU (issue 32 item 1): the time of one step that decodes D running sequences and prefills P
prompt tokens in the same forward (eager), against a pure decode step of the D sequences (CUDA graph) and a pure
prefill step of P tokens; and the prefill capacity beside decoding that gives (what a colocated instance reports
in Stats: P / mixed step) against the schedule it replaced (a prefill step, then a decode step: P / (prefill +
decode)). The mixed step's time is also the TPOT of the running sequences while prompts are prefilled.

    python bench/mixed_steps.py [--model DIR] [--layers 32] [--batches 16,48] [--prefill 512,1024,2048,4096]
        [--context 2048] [--kv-dtype int8] [--json /tmp/mixed_steps.json]

Then what a colocated instance with the auto step budget does at start-up (`pdserve.decode.step_budget`): its
measurement of mixed steps at the --prefill sizes beside 16 short decoding requests, the fixed cost fitted to them
and the prefill tokens per step it chooses, with the prefill capacity it reports until it measured its own.

Engine as a colocated instance serves it (bf16, FA3, fused kernels, decode CUDA graphs, page 16) with a step token
budget large enough that a step takes all P tokens beside its D decode rows, and overlapped decode off (each
step timed alone, the device synchronized around it). Without --model, a random
Llama-3-8B-shaped checkpoint is written into --workdir first (bench/one_gpu.py's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchutil import Table, log, submit

from pdserve.decode.step_budget import choose_prefill_tokens, fixed_cost_ms, measure_step_costs
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def timed_step(e: LLMEngine) -> float:
    """Wall ms of one engine step, the device included."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    e.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def prompt(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(5, vocab, (n,), generator=g).tolist()


def prefill_step_ms(e: LLMEngine, p: int, reps: int, g: torch.Generator) -> float:
    """Median ms of a step that computes one P-token prompt (its first token sampled, then dropped) beside whatever
    runs: nothing (a pure prefill step) or the decode batch (a mixed step)."""
    vocab = e.model_config.vocab_size
    times = []
    for r in range(reps + 2):  # two warm-up steps (Triton specializations of this shape)
        submit(e, f"p{p}-{r}-{time.monotonic_ns()}", prompt(p, vocab, g), ONE_TOKEN)
        ms = timed_step(e)
        assert e.last_step_prefill_tokens == p, (e.last_step_prefill_tokens, p)
        times += [ms] if r >= 2 else []
    return statistics.median(times)


def decode_step_ms(e: LLMEngine, reps: int) -> float:
    for _ in range(3):
        e.step()
    return statistics.median(timed_step(e) for _ in range(reps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="a model directory (default: a random 8B-shaped checkpoint)")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pdserve-one-gpu"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batches", default="16,48", help="decode batch sizes D")
    ap.add_argument("--prefill", default="512,1024,2048,4096", help="prefill tokens P of a step")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens of each decoding sequence")
    ap.add_argument("--kv-dtype", default="int8")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    batches = sorted(int(b) for b in args.batches.split(","))
    sizes = sorted(int(p) for p in args.prefill.split(","))
    model = Path(args.model) if args.model else Path(args.workdir) / f"llama8b-{args.layers}l"
    if not args.model and not (model / "model.safetensors.index.json").exists():
        from pdserve.models.random_llama import write_random_llama

        write_random_llama(model, args.layers, device="cuda:0")
    pages = (max(batches) * (args.context + 1024) + 4 * max(sizes)) // 16 + 64
    cfg = EngineConfig(
        model_dir=str(model), dtype="bfloat16", device="cuda:0", page_size=16, kv_dtype=args.kv_dtype,
        attention_backend="fa3", chunk_size=max(sizes), step_token_budget=max(sizes) + max(batches),
        num_pages=pages, max_num_seqs=max(batches) + 1, overlap_decode="off",
    )  # fmt: skip
    e = LLMEngine(cfg)
    g = torch.Generator().manual_seed(0)
    table, rows = Table(), []
    pure_prefill = {p: prefill_step_ms(e, p, args.reps, g) for p in sizes}
    for p, ms in pure_prefill.items():
        table.row(f"prefill step P={p}", f"{ms:.2f} ms", f"{p / ms:.0f}k tokens/s alone")
    # decoding rows never finish during the measurement: as many tokens as the context leaves
    sp = SamplingParams(max_tokens=e.max_model_len - args.context, temperature=0.0, ignore_eos=True)
    vocab, running = e.model_config.vocab_size, 0
    for d in batches:  # ascending: add sequences up to d, prefilled one at a time
        for i in range(running, d):
            submit(e, f"d{i}", prompt(args.context, vocab, g), sp)
            while e.scheduler.waiting:
                e.step()
        running = d
        dec = decode_step_ms(e, args.reps)
        table.row(f"decode step D={d}", f"{dec:.2f} ms", f"context ~{args.context}")
        for p in sizes:
            mixed = prefill_step_ms(e, p, args.reps, g)
            alt = pure_prefill[p] + dec
            rows.append(
                dict(decode_rows=d, prefill_tokens=p, decode_ms=dec, prefill_ms=pure_prefill[p], mixed_ms=mixed)
            )
            table.row(
                f"mixed step D={d} P={p}",
                f"{mixed:.2f} ms",
                f"prefill capacity beside decoding {p / mixed:.1f}k tokens/s (alternating {p / alt:.1f}k); "
                f"TPOT while prefilling {mixed:.1f} ms (alternating {alt:.1f} ms)",
            )
    for i in range(running):  # the auto budget's measurement starts from an empty engine, as at start-up
        e.abort(f"d{i}")
    while e.has_unfinished_requests():
        e.step()
    costs = measure_step_costs(e, tuple(sizes))
    chosen = choose_prefill_tokens(costs)
    for p, ms in sorted(costs.mixed_ms.items()):
        table.row(f"auto: mixed step D={costs.decode_rows} P={p}", f"{ms:.2f} ms",
                  f"{costs.tokens_per_s(p) / 1e3:.1f}k tokens/s" + (" <- chosen" if p == chosen else ""))  # fmt: skip
    table.row("auto: fixed cost (fit)", f"{fixed_cost_ms(costs):.2f} ms", f"decode step {costs.decode_ms:.2f} ms")
    table.print()
    auto = dict(decode_rows=costs.decode_rows, decode_ms=costs.decode_ms, mixed_ms=costs.mixed_ms, chosen=chosen,
                fixed_cost_ms=fixed_cost_ms(costs), prior_tokens_per_s=costs.tokens_per_s(chosen))  # fmt: skip
    if args.json:
        doc = {"device": torch.cuda.get_device_name(0), "rows": rows, "auto": auto}
        Path(args.json).write_text(json.dumps(doc, indent=1))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
