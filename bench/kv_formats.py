"""KV formats on one Hopper GPU: decode attention per layer at the memory roofline, and engine decode steps at
batch 128 / context 2k with bf16, int8 and fp8 KV (issue 14's speed keys of docs/bench/kv_formats.json).

    python bench/kv_formats.py [--json docs/bench/kv_formats.json] [--skip-engine]

1. Per layer (Llama-3-8B: 8 KV heads, 32 query heads, head_dim 128, page 16), CUDA-graph timed: the int8
   fold-scales kernel with byte-permute conversion (`byte_convert`, the default) and with int -> float
   conversions, block 64/128 x stages 2/3, plus the same kernel over a bf16 pool, at batch 64/128 x context
   2k/8k. Bandwidth fraction = bytes the kernel must read (int8 K/V + fp16 scales; bf16 K/V) / time / copy
   bandwidth (a device-to-device copy, read + write bytes). Every variant is checked against fp64 attention
   over the same dequantized pages first.
2. Engine (decode CUDA graphs, PDL): 128 sequences of 2048 random prompt tokens, median decode step over 30
   steps, per KV format, with the roofline (weights + KV bytes read per step over the copy bandwidth).
   `--interleave N`: the engines are held at once and timed in turns (N rounds of 10 steps each), so that they
   share the board's power and clock states instead of drifting apart between engines built one after another.
Keys are merged into the JSON (quality keys written by bench/kv_quality.py survive).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_engine as ge

DEV = ge.DEV
PS, KVH, D, HQ = 16, 8, 128, 32


# int8 kernel variants timed side by side (each over the default config): the default before the ninth session (four
# warps, 128-key blocks, V through shared memory), one warp without V planes, K converted through the word tiles and
# tl.join (no planes), K read as bytes (`word_loads` off).
INT8_VARIANTS: dict[str, dict] = {
    "default": {},
    "pdl": dict(pdl=True),  # as the engine launches it (programmatic dependent launch)
    "w4_vsmem": dict(v_planes=False, num_warps=4, block_n=128, num_stages=3),
    "w1_vsmem": dict(v_planes=False),
    "words_join": dict(k_planes=False, v_planes=False),
    "bytes": dict(word_loads=False),
    "planes": dict(lean_loop=False),  # the byte-plane kernel, the default before the lean loop (int8_planes_decode.py)
    "planes_pdl": dict(lean_loop=False, pdl=True),
}
# fp8 kernel configs timed beside its default (one warp per program, as the int8 default now)
FP8_VARIANTS: dict[str, dict] = {"w1": dict(num_warps=1, block_n=32, num_stages=3)}


def int8_kernel_sweep(copy_bw: float, shapes: list[tuple[int, int]]) -> dict:
    from pdserve.engine.kernels import int8_decode_attention as kd
    from pdserve.kv import quant as Q

    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    g = torch.Generator(device=DEV).manual_seed(14)
    base = {k: v for k, v in kd.DEFAULT_CONFIG.items() if k != "split_mult"}
    variants = {name: {**base, **c} for name, c in INT8_VARIANTS.items()}
    out: dict = {}
    for B, ctx in shapes:
        W, key = ctx // PS, f"b{B}_ctx{ctx}"
        kv, q8, s8, table, lens, qq = ge.paged_decode_inputs(B, ctx, g, PS, KVH, D, HQ)
        nb = 2
        sub = table[:nb].flatten().long()
        pool = Q.dequantize(q8[:, sub], s8[:, sub], None, 64, torch.float32).view(2, -1, KVH, D)
        ref = ge.paged_attention_ref(qq[:nb], pool, torch.arange(nb * W, device=DEV).int().view(nb, W), PS)
        del pool
        splits = kd.default_num_splits(B, KVH, sms, kd.DEFAULT_CONFIG["split_mult"])  # what the engine launches
        res: dict = {}
        for name, c in variants.items():

            def fn(c=c):
                return kd.int8_paged_decode(
                    qq, q8[0], q8[1], s8[0], s8[1], None, None, table, lens, D**-0.5, splits, **c
                )

            try:
                err = ge.rel_err(fn()[:nb], ref)
                res[name] = {"ms": float("inf"), "rel_err": err, "fn": fn if err < 1e-2 else None}
            except Exception as exc:  # a variant that does not compile/run is reported, not fatal
                ge.log(f"{key} {name}: {type(exc).__name__}: {str(exc)[:300]}")
                res[name] = {"ms": float("inf"), "rel_err": float("nan"), "error": str(exc)[:300], "fn": None}
        # Timed in rounds A B C, C B A, A B C (the first graph timed after a pause runs ~5% slow): best of three.
        names = list(variants)
        for order in (names, names[::-1], names):
            for name in order:
                if res[name]["fn"] is not None:
                    res[name]["ms"] = min(res[name]["ms"], ge.graph_ms(res[name]["fn"]))
        for name in names:
            del res[name]["fn"]
        # The engine's pages: each sequence's in order, one after the other (the shuffled table above spreads them)
        seq_table = torch.arange(B * W, device=DEV, dtype=torch.int32).view(B, W)
        for name in ("default", "w4_vsmem"):
            c = variants[name]
            hp_ms = ge.graph_ms(
                lambda c=c: kd.int8_paged_decode(
                    qq, q8[0], q8[1], s8[0], s8[1], None, None, seq_table, lens, D**-0.5, splits, **c
                )
            )
            res[f"{name}_seq_pages"] = {"ms": hp_ms}
        ge.log(f"{key} in-order pages: " + ", ".join(f"{n} {res[f'{n}_seq_pages']['ms'] * 1e3:.1f} us" for n in (
            "default", "w4_vsmem")))  # fmt: skip
        try:  # the fp8 pool (one scale per token and KV head) through its own kernel
            from pdserve.engine.kernels.fp8_decode_attention import fp8_paged_decode

            f8, fs, _ = Q.quantize(kv, D, False, torch.float8_e4m3fn)
            fp8_fn = lambda: fp8_paged_decode(qq, f8[0], f8[1], fs[0], fs[1], table, lens, D**-0.5, splits)
            fp8_err = ge.rel_err(fp8_fn()[:nb], ge.paged_attention_ref(
                qq[:nb], Q.dequantize(f8[:, sub], fs[:, sub], None, D, torch.float32).view(2, -1, KVH, D),
                torch.arange(nb * W, device=DEV).int().view(nb, W), PS))  # fmt: skip
            fp8_ms = ge.graph_ms(fp8_fn)
            fp8_bytes = 2 * B * ctx * KVH * (D + 2)
            res["fp8"] = {"ms": fp8_ms, "rel_err": fp8_err, "bw_fraction": fp8_bytes / (fp8_ms * 1e-3) / copy_bw}
            for name, c in FP8_VARIANTS.items():

                def fp8_var(c=c):
                    return fp8_paged_decode(qq, f8[0], f8[1], fs[0], fs[1], table, lens, D**-0.5, splits, **c)

                err = ge.rel_err(fp8_var()[:nb], fp8_fn()[:nb])
                ms = ge.graph_ms(fp8_var)
                frac = fp8_bytes / (ms * 1e-3) / copy_bw
                res[f"fp8_{name}"] = {"ms": ms, "diff_vs_default": err, "bw_fraction": frac}
                ge.log(f"{key} fp8 {name}: {ms * 1e3:.1f} us ({res[f'fp8_{name}']['bw_fraction']:.0%}), diff {err:.1e}")
            del f8, fs
        except Exception as exc:
            ge.log(f"{key} fp8: {type(exc).__name__}: {str(exc)[:300]}")
        dense_cfg = {k: v for k, v in kd.DENSE_CONFIG.items() if k != "split_mult"}
        dense_ms = ge.graph_ms(
            lambda: kd.int8_paged_decode(
                qq, kv[0], kv[1], None, None, None, None, table, lens, D**-0.5, splits, **dense_cfg
            )
        )
        int8_bytes = 2 * B * ctx * KVH * (D + 2 * 2)
        bf16_bytes = 2 * B * ctx * KVH * D * 2
        best = {"int8": min(variants, key=lambda k: res[k]["ms"]), "default": "default"}
        for k in variants:
            res[k]["bw_fraction"] = int8_bytes / (res[k]["ms"] * 1e-3) / copy_bw
        res["dense_bf16"] = {"ms": dense_ms, "bw_fraction": bf16_bytes / (dense_ms * 1e-3) / copy_bw}
        res["best"] = best
        out[key] = res
        ge.row(
            f"decode attn/layer {key} (us)",
            " / ".join(f"int8-{cv} {res[b]['ms'] * 1e3:.1f}" for cv, b in best.items())
            + " / "
            + ", ".join(f"{k} {res[k]['ms'] * 1e3:.1f}" for k in variants)
            + f" / bf16 {dense_ms * 1e3:.1f}",
            "of copy BW: "
            + ", ".join(f"int8-{cv} {res[b]['bw_fraction']:.0%}" for cv, b in best.items())
            + f", bf16 {res['dense_bf16']['bw_fraction']:.0%}; best {', '.join(best.values())}"
            + (f"; fp8 {res['fp8']['ms'] * 1e3:.1f} us ({res['fp8']['bw_fraction']:.0%})" if "fp8" in res else ""),
        )
        del kv, q8, s8
        ge.free_memory()
    return out


SWEEP_GRID = dict(  # the grid of the first sweep (2026-12-01); --sweep-grid replaces any of these lists
    word_loads=[False, True], splits=[1, 2, 3, 4, 6, 8], block_n=[64, 128], num_stages=[2, 3], num_warps=[4, 8]
)


def config_sweep(copy_bw: float, shapes: list[tuple[int, int]], grid: dict | None = None) -> dict:
    """The int8 kernel (DEFAULT_CONFIG otherwise) over split count x word loads x block x stages x warps; prints
    the five fastest per shape. One wave of (sequence, head) programs leaves a tail: the split count sets how many
    waves."""
    import itertools

    from pdserve.engine.kernels import int8_decode_attention as kd

    grid = {**SWEEP_GRID, **(grid or {})}
    base_cfg = {k: v for k, v in kd.DEFAULT_CONFIG.items() if k != "split_mult"}

    g = torch.Generator(device=DEV).manual_seed(15)
    out: dict = {}
    for B, ctx in shapes:
        kv, q8, s8, table, lens, qq = ge.paged_decode_inputs(B, ctx, g, PS, KVH, D, HQ)
        del kv  # the int8 pool is what this sweep reads
        base = kd.int8_paged_decode(qq, q8[0], q8[1], s8[0], s8[1], None, None, table, lens, D**-0.5, 1)
        nbytes = 2 * B * ctx * KVH * (D + 2 * 2)
        res = {}
        keys = list(grid)  # SWEEP_GRID's knobs, then any other config key given in --sweep-grid
        for combo in itertools.product(*(grid[k] for k in keys)):
            knobs = dict(zip(keys, combo))
            sp = knobs.pop("splits")
            c = {**base_cfg, **knobs}

            def fn(c=c, sp=sp):
                return kd.int8_paged_decode(qq, q8[0], q8[1], s8[0], s8[1], None, None, table, lens, D**-0.5, sp, **c)

            name = f"{'words' if c['word_loads'] else 'bytes'}_sp{sp}_bn{c['block_n']}_st{c['num_stages']}"
            name += f"_w{c['num_warps']}" + "".join(f"_{k}{v}" for k, v in knobs.items() if k not in SWEEP_GRID)
            try:
                if ge.rel_err(fn(), base) > 1e-2:
                    raise ValueError("differs from the 1-split result")
                res[name] = ge.graph_ms(fn, reps=20)
            except Exception as exc:
                res[name] = float("inf")
                ge.log(f"{name}: {type(exc).__name__} {str(exc)[:120]}")
        top = sorted(res, key=res.get)[:5]
        key = f"b{B}_ctx{ctx}"
        ge.row(
            f"int8 sweep {key} top5 (us, of copy BW)",
            ", ".join(f"{k} {res[k] * 1e3:.0f} ({nbytes / (res[k] * 1e-3) / copy_bw:.0%})" for k in top),
        )
        out[key] = {"ms": res, "bytes": nbytes}
        del q8, s8
        ge.free_memory()
    return out


def profile_step(e, batch: int, tag: str) -> list:
    """CUDA time per kernel of one decode step at `batch` (3 replays of its graph): where the step goes."""
    from torch.profiler import ProfilerActivity, profile

    graph = e.runner.graph_runner.graphs[batch]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda x: -x.device_time_total)
    total = sum(ev.device_time_total for ev in events) / 3 / 1e3
    top = [(ev.key[:80], round(ev.device_time_total / 3 / 1e3, 3), ev.count // 3) for ev in events[:16]]
    ge.log(f"[{tag}] CUDA time per b{batch} step {total:.2f} ms; top kernels (ms, count): " + "; ".join(
        f"{k} {t} x{c}" for k, t, c in top))  # fmt: skip
    return [{"kernel": k, "ms": t, "count": c} for k, t, c in top] + [{"kernel": "(all)", "ms": total}]


def step_row(e, steps: list[float], label: str, weight_bytes: int, copy_bw: float, note: str = "") -> dict:
    """Median of a decode batch's step times against its roofline (weights + the batch's KV bytes over the copy
    bandwidth), printed as a row; the engine-row dict of the JSON."""
    batch = len(e.scheduler.running)
    mean_ctx = sum(s.num_tokens for s in e.scheduler.running) / batch
    kv_token_bytes = e.runner.page_bytes() // e.page_size
    roof = (weight_bytes + batch * mean_ctx * kv_token_bytes) / copy_bw * 1e3
    t = statistics.median(steps)
    ts = sorted(steps)
    ge.row(
        label,
        f"{t:.2f} ms/step ({batch / t * 1e3:.0f} tok/s)",
        f"roofline {roof:.2f} ms: ratio {t / roof:.2f}; p10-p90 {ts[len(ts) // 10 - 1]:.2f}-{ts[-(len(ts) // 10)]:.2f}"
        + note,
    )
    return {
        "step_ms": t,
        "roofline_ms": roof,
        "ratio": t / roof,
        "kv_token_bytes": kv_token_bytes,
        "steps_ms": steps,
        "overlap_decode": e.overlap_decode,  # greedy steps launched one ahead (EngineConfig.overlap_decode)
    }


def engine_steps(
    model_dir: Path,
    kv: str,
    copy_bw: float,
    weight_bytes: int,
    batch: int = 128,
    ctx: int = 2048,
    profile: bool = False,
    decode_config: str = "",
    batch_invariant: bool = False,
    prefill: bool = False,
    overlap: str = "auto",
) -> dict:
    tag = kv + (f" {decode_config}" if decode_config else "") + (" batch-invariant" if batch_invariant else "")
    tag += f" overlap {overlap}" if overlap != "auto" else ""
    kw: dict = dict(decode_kernel_config=decode_config) if decode_config else {}
    pages = batch * (ctx // PS + 8) + 64
    e = ge.make_engine(model_dir, kv, num_pages=pages, batch_invariant=batch_invariant, overlap_decode=overlap, **kw)
    prefill_ms = None
    if prefill:  # on the empty engine: a fresh 2k prompt to its first token, median of 3 after a warm-up
        g = torch.Generator().manual_seed(11)
        prefill_ms = ge.time_prefill(e, lambda: torch.randint(5, ge.SHAPE["vocab_size"], (ctx,), generator=g).tolist())
        ge.row(f"engine prefill {ctx // 1024}k to first token, {tag} KV", f"{prefill_ms:.1f} ms", "")
    ge.fill_decode_batch(e, batch, ctx, torch.Generator().manual_seed(9))
    steps = ge.time_decode_steps(e, 34)[4:]
    out = step_row(e, steps, f"engine decode b{batch} ctx{ctx // 1024}k, {tag} KV", weight_bytes, copy_bw)
    if prefill_ms is not None:
        out["prefill_ms_2k"] = prefill_ms
    if profile:
        out["kernels"] = profile_step(e, batch, tag)
        out["host_profile"] = ge.host_profile(e, 5)
    del e
    ge.free_memory()
    return out


def interleaved_steps(
    model_dir: Path, engines: dict[str, dict], copy_bw: float, weight_bytes: int, rounds: int, steps: int = 10
) -> dict:
    """Decode steps (b128 ctx2k) of several engines held at once, timed in turns: per round, each engine runs 2
    untimed steps, then `steps` timed ones, then the GPU drains. Side by side in time, the engines share the board's
    power and clock states, which drift between engines built one after another. `engines`: name -> make_engine
    keyword arguments (kv plus config overrides)."""
    batch, ctx = 128, 2048
    pages = batch * (ctx // PS + 8) + 64
    built = {}
    for name, kw in engines.items():
        e = ge.make_engine(model_dir, num_pages=pages, **kw)
        ge.fill_decode_batch(e, batch, ctx, torch.Generator().manual_seed(9))
        built[name] = e
    times: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(rounds):
        for name, e in built.items():
            ge.time_decode_steps(e, 2)
            times[name] += ge.time_decode_steps(e, steps)
            torch.cuda.synchronize()
    out = {}
    for name, e in built.items():
        label = f"engine decode b{batch} ctx{ctx // 1024}k, {name} KV, interleaved"
        out[name] = step_row(e, times[name], label, weight_bytes, copy_bw, f"; {rounds} rounds of {steps}")
        out[name]["interleaved"] = {"rounds": rounds, "steps_per_round": steps}
    del built
    ge.free_memory()
    return out


def kv_formats_available() -> list[str]:
    """Engine KV formats to compare: bf16 ("auto" on a bf16 model), int8, and fp8 where the engine has it."""
    from pdserve.kv import dtypes

    return ["auto", *dtypes.QUANTIZED]


def keys_from_log(log: Path, out: Path) -> None:
    """Write the speed keys from the lines a run printed (a run cut short before it wrote its JSON)."""
    import re

    text = log.read_text()
    head = text.splitlines()[0]
    copy_bw = float(re.search(r"copy bandwidth \(read\+write\): ([\d.]+) TB/s", text).group(1)) * 1e12
    m = re.search(r"b128_ctx2048 \(us\): int8-default ([\d.]+) .* bf16 ([\d.]+) .*fp8 ([\d.]+) us", text)
    int8_us, bf16_us, fp8_us = (float(x) for x in m.groups())
    b, ctx = 128, 2048
    steps = dict(re.findall(r"engine decode b128 ctx2k, (\w+) KV: ([\d.]+) ms/step", text))
    result = {
        "int8_attn_bw_fraction_b128": 2 * b * ctx * KVH * (D + 2 * 2) / (int8_us * 1e-6) / copy_bw,
        "fp8_attn_bw_fraction_b128": 2 * b * ctx * KVH * (D + 2) / (fp8_us * 1e-6) / copy_bw,
        "bf16_attn_bw_fraction_b128": 2 * b * ctx * KVH * D * 2 / (bf16_us * 1e-6) / copy_bw,
        "bf16_step_ms_b128": float(steps["auto"]) if "auto" in steps else None,
        "int8_step_ms_b128": float(steps["int8"]) if "int8" in steps else None,
        "fp8_step_ms_b128": float(steps["fp8"]) if "fp8" in steps else None,
        "copy_bw": copy_bw,
        "commit": re.search(r"commit (\w+)", head).group(1),
        "device": "NVIDIA H200",
        "date": re.search(r"(\d{4}-\d\d-\d\d)", head).group(1),
        "speed_source": str(log),
    }
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged.update(result)
    out.write_text(json.dumps(merged, indent=1))
    print(json.dumps(result, indent=1))


def batch_invariant_rows(model_dir: Path, out: Path, copy_bw: float) -> None:
    """The price of `--batch-invariant` on the GPU (issue 14, item 5: default if it costs <= 5% at b64): int8 KV
    decode steps at b64 and b128 (context 2k) and a 2k prefill, off and on, merged into `out` as batch_invariant."""
    n_params = ge.write_checkpoint(model_dir, 32)
    rows: dict = {}
    for batch in (64, 128):
        for inv in (False, True):
            r = engine_steps(
                model_dir, "int8", copy_bw, n_params * 2, batch=batch, batch_invariant=inv, prefill=batch == 64
            )
            rows[f"b{batch}_{'on' if inv else 'off'}"] = r
    result = {
        "batch_invariant": {
            **rows,
            "step_cost_b64": rows["b64_on"]["step_ms"] / rows["b64_off"]["step_ms"],
            "step_cost_b128": rows["b128_on"]["step_ms"] / rows["b128_off"]["step_ms"],
            "prefill_cost_2k": rows["b64_on"]["prefill_ms_2k"] / rows["b64_off"]["prefill_ms_2k"],
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": ge.git_commit(),
            "device": torch.cuda.get_device_name(DEV),
            "command": "python bench/kv_formats.py --batch-invariant",
        }
    }
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged.update(result)
    out.write_text(json.dumps(merged, indent=1))
    ge.print_rows()
    print(json.dumps({k: v for k, v in result["batch_invariant"].items() if not isinstance(v, dict)}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="docs/bench/kv_formats.json")
    ap.add_argument("--model-dir", default="/dev/shm/llama3-8b-random")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--formats", default="", help="engine KV formats (default: auto,int8[,fp8])")
    ap.add_argument("--sweep", action="store_true", help="only the int8 kernel config sweep")
    ap.add_argument("--sweep-grid", default="", help='JSON: lists replacing SWEEP_GRID\'s (e.g. {"num_stages": [1]})')
    ap.add_argument("--sweep-shapes", default="128x2048,64x2048,128x8192,64x8192", help="batch x context, ...")
    ap.add_argument("--skip-kernels", action="store_true", help="engine steps only (no per-layer kernel sweep)")
    ap.add_argument("--profile", action="store_true", help="CUDA time per kernel of one b128 engine step")
    ap.add_argument(
        "--int8-configs", default="", help="';'-separated JSON decode-kernel configs: more int8 engine rows"
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="only: int8 engine rows with --batch-invariant off and on (b64, b128 decode steps; 2k prefill)",
    )
    ap.add_argument("--from-log", default="", help="no measuring: the speed keys from an earlier run's printed lines")
    ap.add_argument(
        "--overlap-rows", action="store_true", help="engine rows: each format again with --overlap-decode off"
    )
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="engine rows from all engines held at once, timed in turns for this many rounds (the step keys too)",
    )
    args = ap.parse_args()
    if args.from_log:
        keys_from_log(Path(args.from_log), Path(args.json))
        return
    copy_bw, _ = ge.ceilings()
    if args.batch_invariant:
        batch_invariant_rows(Path(args.model_dir), Path(args.json), copy_bw)
        return
    if args.sweep:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.sweep_shapes.split(",")]
        sweep = config_sweep(copy_bw, shapes, json.loads(args.sweep_grid) if args.sweep_grid else None)
        Path(args.json).write_text(json.dumps(sweep, indent=1))
        return
    result: dict = {"copy_bw": copy_bw}
    if not args.skip_kernels:
        sweep = int8_kernel_sweep(copy_bw, [(128, 2048), (64, 2048), (128, 8192), (64, 8192)])
        b128 = sweep["b128_ctx2048"]
        result.update(
            int8_attn_bw_fraction_b128=b128[b128["best"]["default"]]["bw_fraction"],
            bf16_attn_bw_fraction_b128=b128["dense_bf16"]["bw_fraction"],
            attention_per_layer=sweep,
        )
        if "fp8" in b128:
            result["fp8_attn_bw_fraction_b128"] = b128["fp8"]["bw_fraction"]
    if not args.skip_engine:
        n_params = ge.write_checkpoint(Path(args.model_dir), 32)
        formats = args.formats.split(",") if args.formats else kv_formats_available()
        configs = list(filter(None, args.int8_configs.split(";")))
        if args.interleave:
            engines: dict[str, dict] = {kv: {"kv": kv} for kv in formats}
            for cfg in configs:
                engines[f"int8 {cfg}"] = {"kv": "int8", "decode_kernel_config": cfg}
            engine = interleaved_steps(Path(args.model_dir), engines, copy_bw, n_params * 2, args.interleave)
            result["engine_b128_ctx2k_interleaved"] = engine
        else:
            engine = {
                kv: engine_steps(Path(args.model_dir), kv, copy_bw, n_params * 2, profile=args.profile)
                for kv in formats
            }
            if args.overlap_rows:  # the same formats without overlapped decode, same run
                for kv in formats:
                    engine[f"{kv} overlap off"] = engine_steps(
                        Path(args.model_dir), kv, copy_bw, n_params * 2, profile=args.profile, overlap="off"
                    )
            for cfg in configs:
                engine[f"int8 {cfg}"] = engine_steps(
                    Path(args.model_dir), "int8", copy_bw, n_params * 2, profile=args.profile, decode_config=cfg
                )
            result["engine_b128_ctx2k"] = engine
        for kv, key in (("auto", "bf16_step_ms_b128"), ("int8", "int8_step_ms_b128"), ("fp8", "fp8_step_ms_b128")):
            if kv in engine:
                result[key] = engine[kv]["step_ms"]
    result.update(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        commit=ge.git_commit(),
        device=torch.cuda.get_device_name(DEV),
    )
    path = Path(args.json)
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1))
    ge.print_rows()


if __name__ == "__main__":
    sys.exit(main())
