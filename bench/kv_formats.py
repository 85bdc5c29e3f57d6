"""KV formats (bf16, int8 g=64 / g=32, fp8 e4m3): what each costs in decode speed on one Hopper GPU, and in quality on
trained weights (the speed and quality keys of docs/bench/kv_formats.json).

    python bench/kv_formats.py [--interleave 6] [--json docs/bench/kv_formats.json]        # speed, GPU
    python bench/kv_formats.py --sweep [--sweep-grid JSON] [--sweep-shapes 64x2048,...]     # int8 launch configs, GPU
    python bench/kv_formats.py --batch-invariant                                            # its price, GPU
    python bench/kv_formats.py --quality [--models tiny,smol] [--device cpu]               # quality, CPU or GPU

Speed: 1. per layer (Llama-3-8B heads: 8 KV, 32 query, head_dim 128, page 16), CUDA-graph timed, each kernel first
checked against fp64 attention over the same pages: the int8 decode kernel as the engine launches it (plus any
`--int8-configs` overrides), the fp8 kernel, the same Triton kernel over a bf16 pool; at batch 64/128 x context
2k/8k, best of three rounds in alternating order. Bandwidth fraction = bytes the kernel must read / time / copy
bandwidth (read + write of a device copy). 2. The 8B engine (random bf16 weights, decode CUDA graphs): 128
sequences of 2048 random prompt tokens, decode step per KV format against its roofline (weights + KV bytes read
once, over the copy bandwidth). `--interleave N` holds the engines at once and times them in turns (N rounds of 10
steps), so that they share the board's power and clock states.

Quality: teacher-forced perplexity and top-1 agreement against fp32 KV through the engine's own prefill + decode
path (`pdserve.testing.teacher_forcing`), float32 model and SDPA in every row so only the KV pool differs. Models:
the tiny llama trained on the shipped corpus (scored on its held-out tenth) and SmolLM2-135M-Instruct (the whole
corpus is unseen by it). Sets: "short", `--seqs` windows of `--prompt` + `--forced` tokens; "long", one window whose
`--long-forced` scored tokens follow `--long-prompt` (>= 4k) tokens of context.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from benchutil import Table, log, merge_json, provenance

PS, KVH, D, HQ = 16, 8, 128, 32
SHAPES = [(128, 2048), (64, 2048), (128, 8192), (64, 8192)]
MODELS = {"tiny": "tiny llama trained on the shipped corpus", "smol": "SmolLM2-135M-Instruct (GGUF Q4_1 -> fp32)"}
# quality rows: format name -> EngineConfig fields ("bf16": a dense bf16 pool under the fp32 model, see `engine`)
FORMATS: dict[str, dict] = {
    "fp32": dict(kv_dtype="auto"),
    "bf16": dict(kv_dtype="auto"),
    "int8-g64": dict(kv_dtype="int8", kv_group_size=64),
    "int8-g32": dict(kv_dtype="int8", kv_group_size=32),
    "fp8": dict(kv_dtype="fp8"),
}


# ---- speed: per layer -----------------------------------------------------------------------------------------
def attention_rows(ge, table: Table, copy_bw: float, int8_configs: list[dict]) -> dict:
    """Per-layer decode attention of every format at every shape (`ge`: bench/gpu_engine.py, the GPU helpers)."""
    from pdserve.engine.kernels import int8_decode_attention as kd
    from pdserve.engine.kernels.fp8_decode_attention import fp8_paged_decode
    from pdserve.engine.kernels.paged_decode_common import default_num_splits
    from pdserve.kv import quant as Q

    sms = torch.cuda.get_device_properties(ge.DEV).multi_processor_count
    g = torch.Generator(device=ge.DEV).manual_seed(14)
    out: dict = {}
    for B, ctx in SHAPES:
        W, key, nb = ctx // PS, f"b{B}_ctx{ctx}", 2
        kv, q8, s8, pages, lens, qq = ge.paged_decode_inputs(B, ctx, g, PS, KVH, D, HQ)
        f8, fs, _ = Q.quantize(kv, D, False, torch.float8_e4m3fn)  # one scale per (token, KV head)
        sub, flat = pages[:nb].flatten().long(), torch.arange(nb * W, device=ge.DEV).int().view(nb, W)

        def ref(data, scales, group):  # fp64 attention of the first sequences over the dequantized pages
            pool = Q.dequantize(data[:, sub], scales[:, sub], None, group, torch.float32).view(2, -1, KVH, D)
            return ge.paged_attention_ref(qq[:nb], pool, flat, PS)

        splits = default_num_splits(B, KVH, sms, kd.DEFAULT_CONFIG["split_mult"])  # what the engine launches
        dense_cfg = {k: v for k, v in kd.DENSE_CONFIG.items() if k != "split_mult"}
        fns = {"int8": lambda c={}: kd.int8_paged_decode(qq, q8[0], q8[1], s8[0], s8[1], None, None, pages, lens,
                                                           D**-0.5, splits, **c)}  # fmt: skip
        for i, c in enumerate(int8_configs):
            fns[f"int8_cfg{i}"] = lambda c=c: fns["int8"](c)
        fns["fp8"] = lambda: fp8_paged_decode(qq, f8[0], f8[1], fs[0], fs[1], pages, lens, D**-0.5, splits)
        fns["bf16"] = lambda: kd.int8_paged_decode(
            qq, kv[0], kv[1], None, None, None, None, pages, lens, D**-0.5, splits, **dense_cfg
        )
        refs = {"int8": ref(q8, s8, 64), "fp8": ref(f8, fs, D), "bf16": ge.paged_attention_ref(
            qq[:nb], kv[:, sub].float().view(2, -1, KVH, D), flat, PS)}  # fmt: skip
        nbytes = {
            "int8": 2 * B * ctx * KVH * (D + 4),
            "fp8": 2 * B * ctx * KVH * (D + 2),
            "bf16": 4 * B * ctx * KVH * D,
        }
        res: dict = {}
        for name, fn in fns.items():
            fmt = name.split("_")[0]
            try:
                err = ge.rel_err(fn()[:nb], refs[fmt])
                res[name] = {"ms": math.inf, "rel_err": err, "ok": err < 1e-2}  # a wrong kernel is not timed
            except Exception as exc:  # a config that does not compile is reported, not fatal
                log(f"{key} {name}: {type(exc).__name__}: {str(exc)[:300]}")
                res[name] = {"ms": math.inf, "rel_err": math.nan, "ok": False}
        for order in (list(fns), list(fns)[::-1], list(fns)):  # the first graph after a pause runs ~5% slow
            for name in order:
                if res[name]["ok"]:
                    res[name]["ms"] = min(res[name]["ms"], ge.graph_ms(fns[name]))
        for name, r in res.items():
            r["bw_fraction"] = nbytes[name.split("_")[0]] / (r["ms"] * 1e-3) / copy_bw
        out[key] = res
        table.row(f"decode attention per layer {key}", ", ".join(f"{n} {r['ms'] * 1e3:.1f} us" for n, r in res.items()),
                  "of copy BW: " + ", ".join(f"{n} {r['bw_fraction']:.0%}" for n, r in res.items()))  # fmt: skip
        del kv, q8, s8, f8, fs
        ge.free_memory()
    return out


def config_sweep(ge, table: Table, copy_bw: float, shapes: list[tuple[int, int]], grid: dict) -> dict:
    """The int8 kernel over every combination of `grid` (launch-config lists; `splits` is the split count, the rest
    int8_paged_decode keywords), each checked against the 1-split default; prints the five fastest per shape."""
    from pdserve.engine.kernels import int8_decode_attention as kd

    g = torch.Generator(device=ge.DEV).manual_seed(15)
    grid = {"splits": [1, 2, 3, 4], **grid}
    out: dict = {}
    for B, ctx in shapes:
        _, q8, s8, pages, lens, qq = ge.paged_decode_inputs(B, ctx, g, PS, KVH, D, HQ)
        call = lambda sp, **c: kd.int8_paged_decode(qq, q8[0], q8[1], s8[0], s8[1], None, None, pages, lens,
                                                    D**-0.5, sp, **c)  # fmt: skip
        base, res = call(1), {}
        for combo in itertools.product(*grid.values()):
            c = dict(zip(grid, combo))
            name = "_".join(f"{k}{v}" for k, v in c.items())
            sp = c.pop("splits")
            try:
                if ge.rel_err(call(sp, **c), base) > 1e-2:
                    raise ValueError("differs from the 1-split default")
                res[name] = ge.graph_ms(lambda c=c, sp=sp: call(sp, **c), reps=20)
            except Exception as exc:
                res[name] = math.inf
                log(f"{name}: {type(exc).__name__} {str(exc)[:120]}")
        nbytes = 2 * B * ctx * KVH * (D + 4)
        table.row(f"int8 sweep b{B}_ctx{ctx} top5 (us, of copy BW)", ", ".join(
            f"{k} {res[k] * 1e3:.0f} ({nbytes / (res[k] * 1e-3) / copy_bw:.0%})"
            for k in sorted(res, key=res.get)[:5]))  # fmt: skip
        out[f"b{B}_ctx{ctx}"] = {"ms": res, "bytes": nbytes}
        ge.free_memory()
    return out


# ---- speed: engine steps --------------------------------------------------------------------------------------
def step_row(ge, table: Table, e, steps: list[float], label: str, weight_bytes: int, copy_bw: float) -> dict:
    """Median of a decode batch's step times against its roofline, printed as a row; the JSON's engine row."""
    batch = len(e.scheduler.running)
    mean_ctx = sum(s.num_tokens for s in e.scheduler.running) / batch
    kv_token_bytes = e.runner.page_bytes() // e.page_size
    roof = (weight_bytes + batch * mean_ctx * kv_token_bytes) / copy_bw * 1e3
    t, dec = statistics.median(steps), statistics.quantiles(steps, n=10)
    table.row(label, f"{t:.2f} ms/step ({batch / t * 1e3:.0f} tok/s)",
              f"roofline {roof:.2f} ms: ratio {t / roof:.2f}; p10-p90 {dec[0]:.2f}-{dec[-1]:.2f}")  # fmt: skip
    return {"step_ms": t, "roofline_ms": roof, "ratio": t / roof, "kv_token_bytes": kv_token_bytes, "steps_ms": steps}


def engine_rows(ge, table: Table, model_dir: Path, engines: dict[str, dict], copy_bw: float, weight_bytes: int,
                rounds: int, batch: int = 128, ctx: int = 2048, prefill: bool = False) -> dict:  # fmt: skip
    """Decode steps (batch x ctx) of several engines held at once, timed in turns: per round each engine runs 2
    untimed steps, then 10 timed ones. `engines`: name -> make_engine keywords (kv plus config overrides).
    `prefill`: also each engine's 2k prompt to its first token, before its batch is filled."""
    pages = batch * (ctx // PS + 8) + 64
    built, out = {}, {}
    for name, kw in engines.items():
        e = built[name] = ge.make_engine(model_dir, num_pages=pages, **kw)
        if prefill:
            g = torch.Generator().manual_seed(11)
            ms = ge.time_prefill(e, lambda: torch.randint(5, ge.SHAPE["vocab_size"], (2048,), generator=g).tolist())
            out[name] = {"prefill_ms_2k": ms}
            table.row(f"engine prefill 2k to first token, {name}", f"{ms:.1f} ms")
        ge.fill_decode_batch(e, batch, ctx, torch.Generator().manual_seed(9))
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(rounds):
        for name, e in built.items():
            ge.time_decode_steps(e, 2)
            times[name] += ge.time_decode_steps(e, 10)
            torch.cuda.synchronize()
    for name, e in built.items():
        label = f"engine decode b{batch} ctx{ctx // 1024}k, {name} KV, {rounds} rounds"
        out[name] = {**out.get(name, {}), **step_row(ge, table, e, times[name], label, weight_bytes, copy_bw)}
    del built
    ge.free_memory()
    return out


# ---- quality --------------------------------------------------------------------------------------------------
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


def quality_engine(model_dir: Path, fmt: str, device: str, max_len: int, seqs: int):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.kv_cache import KVCache

    e = LLMEngine(EngineConfig(model_dir=str(model_dir), device=device, dtype="float32", attention_backend="sdpa",
                               cuda_graphs=False, page_size=16, chunk_size=512, max_num_seqs=seqs,
                               num_pages=seqs * (-(-max_len // 16) + 1), **FORMATS[fmt]))  # fmt: skip
    if fmt == "bf16":  # K/V rounded to bf16 when stored, math in fp32
        o = e.runner.kv_cache
        e.runner.kv_cache = KVCache(o.num_layers, o.num_pages, o.page_size, o.num_kv_heads, o.head_dim, torch.bfloat16,
                                    o.device)  # fmt: skip
    return e


def quality_set(model: str, model_dir: Path, set_name: str, wins: list[list[int]], prompt: int, device: str,
                formats: list[str]) -> list[Row]:  # fmt: skip
    from pdserve.testing.teacher_forcing import forced_logits

    prompts, forced = [w[:prompt] for w in wins], [w[prompt:] for w in wins]
    tgt = torch.tensor([t for f in forced for t in f])
    max_len, ref, rows = max(len(w) for w in wins), None, []
    for fmt in ["fp32"] + [f for f in formats if f != "fp32"]:
        t0 = time.perf_counter()
        lg = torch.cat(
            forced_logits(quality_engine(model_dir, fmt, device, max_len, len(wins)), prompts, forced)
        ).float()
        nll = torch.nn.functional.cross_entropy(lg, tgt, reduction="none")
        ref = ref or (nll, lg.argmax(-1), lg)
        ppl = math.exp(nll.mean().item())
        row = Row(model, set_name, fmt, nll.numel(), max_len - 1, round(ppl, 4),
                  round(ppl / math.exp(ref[0].mean().item()), 5),
                  round((lg.argmax(-1) == ref[1]).float().mean().item(), 4),
                  round((lg - ref[2]).abs().max().item(), 4), round(time.perf_counter() - t0, 1))  # fmt: skip
        print(json.dumps(asdict(row)), flush=True)
        rows.append(row)
    return rows


def quality(args) -> None:
    from transformers import AutoTokenizer

    from pdserve.models.demo import ensure_smol, ensure_tiny_trained
    from pdserve.models.train_tiny import split_corpus

    formats = args.formats.split(",") if args.formats else list(FORMATS)
    if set(formats) - set(FORMATS):
        raise SystemExit(f"unknown formats {sorted(set(formats) - set(FORMATS))}; known: {', '.join(FORMATS)}")
    torch.manual_seed(0)
    rows: list[Row] = []
    for name in args.models.split(","):
        path = ensure_tiny_trained() if name == "tiny" else ensure_smol()
        text = split_corpus()[1] if name == "tiny" else "\n".join(split_corpus())  # smol has seen none of it
        ids = AutoTokenizer.from_pretrained(str(path))(text)["input_ids"]
        n, length = args.seqs, args.prompt + args.forced
        if n * length > len(ids):
            raise SystemExit(f"text has {len(ids)} tokens, {n} windows of {length} need more")
        wins = [ids[i * (len(ids) // n) :][:length] for i in range(n)]
        rows += quality_set(name, path, "short", wins, args.prompt, args.device, formats)
        long_len = args.long_prompt + args.long_forced
        if args.long_forced and long_len <= json.loads((path / "config.json").read_text())["max_position_embeddings"]:
            rows += quality_set(name, path, "long", [ids[:long_len]], args.long_prompt, args.device, formats)
    header = "| model | set | KV | scored | context | ppl | ppl / fp32 | top-1 agree | max abs dlogit |"
    print(f"\n{header}\n" + "|---" * 9 + "|")
    for r in rows:
        print(f"| {r.model} | {r.set} | {r.format} | {r.scored} | {r.context} | {r.ppl:.4f} | {r.ppl_ratio:.5f} | "
              f"{r.top1_agree:.4f} | {r.max_abs_dlogit:.4f} |")  # fmt: skip
    if args.json:  # the real checkpoint's short set gives the keys; quality_rows keeps earlier rows not re-measured
        path = Path(args.json)
        old = json.loads(path.read_text()).get("quality_rows", []) if path.exists() else []
        new = {(r.model, r.set, r.format) for r in rows}
        main_model = "smol" if "smol" in args.models.split(",") else rows[0].model
        short = {r.format: r for r in rows if r.model == main_model and r.set == "short"}
        keys = {f"ppl_{k}_kv": short[f].ppl for k, f in (("fp32", "fp32"), ("bf16", "bf16"), ("int8", "int8-g64"),
                                                          ("fp8", "fp8")) if f in short}  # fmt: skip
        agree = (("int8", "int8-g64"), ("fp8", "fp8"))
        keys.update({f"top1_agree_{k}": short[f].top1_agree for k, f in agree if f in short})
        prov = provenance(args.commit, args.device)
        merge_json(path, {**keys, "model": MODELS[main_model], **{f"quality_{k}": v for k, v in prov.items()},
                          "quality_rows": [r for r in old if (r["model"], r["set"], r["format"]) not in new]
                          + [asdict(r) for r in rows]})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="docs/bench/kv_formats.json")
    ap.add_argument("--commit", default="", help="the commit measured (a copied tree may lack git)")
    ap.add_argument("--formats", default="", help="KV formats (speed: auto,int8,fp8; quality: every FORMATS name)")
    ap.add_argument("--model-dir", default="/dev/shm/llama3-8b-random")
    ap.add_argument("--skip-kernels", action="store_true", help="engine steps only")
    ap.add_argument("--skip-engine", action="store_true", help="per-layer kernels only")
    ap.add_argument("--int8-configs", default="", help="';'-separated JSON int8 kernel overrides: more rows")
    ap.add_argument("--interleave", type=int, default=6, help="rounds of 10 steps, engines timed in turns")
    ap.add_argument("--sweep", action="store_true", help="only the int8 launch-config sweep (into --json)")
    ap.add_argument("--sweep-grid", default='{"block_n":[32,64],"num_stages":[2,3],"num_warps":[1]}')
    ap.add_argument("--sweep-shapes", default="128x2048,64x2048,64x8192", help="batch x context, ...")
    ap.add_argument("--batch-invariant", action="store_true", help="only: int8 engines with --batch-invariant off/on")
    ap.add_argument("--quality", action="store_true", help="only the quality rows (CPU unless --device cuda)")
    ap.add_argument("--device", default="cpu", help="--quality: where the rows run")
    ap.add_argument("--models", default="tiny,smol", help="--quality: tiny, smol")
    ap.add_argument("--seqs", type=int, default=8, help="--quality short set: windows")
    ap.add_argument("--prompt", type=int, default=64, help="--quality short set: prompt tokens per window")
    ap.add_argument("--forced", type=int, default=256, help="--quality short set: scored tokens per window")
    ap.add_argument("--long-prompt", type=int, default=4096, help="--quality long set: context before the scored")
    ap.add_argument("--long-forced", type=int, default=256, help="--quality long set: scored tokens (0: none)")
    args = ap.parse_args()
    if args.quality:
        return quality(args)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_engine as ge

    table = Table()
    copy_bw, _ = ge.ceilings(table)
    prov = {**provenance(args.commit, torch.cuda.get_device_name(ge.DEV)), "copy_bw": copy_bw}
    if args.sweep:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.sweep_shapes.split(",")]
        sweep = config_sweep(ge, table, copy_bw, shapes, json.loads(args.sweep_grid))
        merge_json(args.json, {f"int8_config_sweep_{prov['commit']}": {**sweep, **prov}})
        return table.print()
    model_dir = Path(args.model_dir)
    weight_bytes = 2 * ge.write_checkpoint(model_dir, 32) if not args.skip_engine or args.batch_invariant else 0
    if args.batch_invariant:  # issue 14 item 5's rule: the default only if it costs <= 5% at b64
        rows = {}
        for b in (64, 128):
            engines = {f"b{b}_{s}": dict(kv="int8", batch_invariant=s == "on") for s in ("off", "on")}
            rows |= engine_rows(ge, table, model_dir, engines, copy_bw, weight_bytes, 3, batch=b, prefill=b == 64)
        cost = lambda a, k: rows[f"{a}_on"][k] / rows[f"{a}_off"][k]
        merge_json(args.json, {"batch_invariant": {**rows, "step_cost_b64": cost("b64", "step_ms"),
                   "step_cost_b128": cost("b128", "step_ms"), "prefill_cost_2k": cost("b64", "prefill_ms_2k"),
                   **prov}})  # fmt: skip
        return table.print()
    keys: dict = {}
    configs = [json.loads(c) for c in filter(None, args.int8_configs.split(";"))]
    if not args.skip_kernels:
        layers = keys["attention_per_layer"] = attention_rows(ge, table, copy_bw, configs)
        for fmt in ("int8", "fp8", "bf16"):
            keys[f"{fmt}_attn_bw_fraction_b128"] = layers["b128_ctx2048"][fmt]["bw_fraction"]
    if not args.skip_engine:
        from pdserve.kv import dtypes

        formats = args.formats.split(",") if args.formats else ["auto", *dtypes.QUANTIZED]
        engines = {kv: {"kv": kv} for kv in formats}
        engines |= {f"int8 {json.dumps(c)}": {"kv": "int8", "decode_kernel_config": json.dumps(c)} for c in configs}
        steps = keys["engine_b128_ctx2k"] = engine_rows(
            ge, table, model_dir, engines, copy_bw, weight_bytes, args.interleave
        )
        for kv, fmt in (("auto", "bf16"), ("int8", "int8"), ("fp8", "fp8")):
            if kv in steps:
                keys[f"{fmt}_step_ms_b128"] = steps[kv]["step_ms"]
    merge_json(args.json, {**keys, **prov})
    table.print()


if __name__ == "__main__":
    sys.exit(main())
