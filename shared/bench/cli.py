"""`pdserve bench`: load a router with streamed requests and report latency, throughput and goodput.

    pdserve bench --target HOST:PORT --tokenizer MODEL_DIR --rates 1,2,4 --num-requests 200 \\
        --input-dist lognormal:1500,0.6,4096 --output-dist lognormal:256,0.5,512 --json out.json --plots plots/
    pdserve bench plot disagg.json colocated.json --labels disagg,colocated --out plots/

See docs/benchmarks.md ("pdserve bench") for the flags, the JSON and the definitions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.plots import load_label
from pdserve.bench.report import SLO, SLO_PRESETS, request_rows, summarize, sweep, table
from pdserve.bench.runner import ClientOptions, Load, run_load, run_workers
from pdserve.bench.workload import (
    LengthDist,
    PromptMaker,
    RequestSpec,
    SpecStream,
    Vocabulary,
    load_trace,
    open_loop_specs,
)
from pdserve.cli.client_args import add_client_args, add_target_arg, client_options

SCHEMA = "pdserve.bench/1"
LAG_WARN_MS = 20.0  # open loop: a p99 send delay past this means requests left later than planned
# output tokens/s one client process reads with time to spare: below it a late send is not the client's own load
WORKER_TOKENS_PER_S = 2000.0


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated request rates, got {text!r}") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 (inf: all at once), got {text!r}")
    return rates


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"want integers >= 1, got {text!r}")
    return values


def _dist(text: str) -> LengthDist:
    try:
        return LengthDist.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench",
        description="Load a pdserve router with streamed requests of exact lengths (fresh prompts, ignore_eos) and "
        "report TTFT, TPOT, ITL, end-to-end latency, throughput, errors and goodput. "
        "`pdserve bench plot RESULT.json...` redraws plots from saved results. "
        "The SLO defaults are GPU figures (--slo-preset gpu: TTFT <= 350 ms, TPOT <= 15 ms); on CPU use "
        "--slo-preset cpu or set --slo-ttft-ms / --slo-tpot-ms.",
    )
    add_target_arg(p)
    add_client_args(p)  # --token, --tls-ca, --tls (docs/security.md)
    vocab = p.add_mutually_exclusive_group(required=True)
    vocab.add_argument(
        "--tokenizer", help="the served model's directory: prompts are ordinary tokens of its vocabulary"
    )
    vocab.add_argument("--vocab-size", type=int, help="without the model directory: prompt ids in [0, N)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=_rates, help="Poisson arrivals at this many requests/s (inf: all at once)")
    load.add_argument("--rates", type=_rates, help="a sweep: comma-separated rates, one run each, ascending")
    load.add_argument("--concurrency", type=_ints, help="closed loop: this many streams (comma-separated: a sweep)")
    load.add_argument("--trace", help="replay a JSONL trace: arrival_s, input_tokens, output_tokens per line")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=int, default=None, help="requests per run (default 200; trace: all)")
    size.add_argument("--duration", type=float, default=None, help="seconds of arrivals per run (then drain)")
    p.add_argument("--warmup", type=int, default=8, help="requests sent (and not measured) before the first run")
    p.add_argument("--input-dist", type=_dist, default=LengthDist.parse("lognormal:1500,0.6,4096"), help="prompt "
                   "lengths: fixed:N, uniform:LO,HI or lognormal:MEAN,SIGMA,MAX (default %(default)s)")  # fmt: skip
    p.add_argument("--output-dist", type=_dist, default=LengthDist.parse("lognormal:256,0.5,512"), help="output "
                   "lengths, exact (ignore_eos): same forms (default %(default)s)")  # fmt: skip
    presets = ", ".join(f"{k}: TTFT {t:g} ms, TPOT {o:g} ms" for k, (t, o) in SLO_PRESETS.items())
    p.add_argument("--slo-preset", choices=sorted(SLO_PRESETS), default="gpu",
                   help=f"the SLO's TTFT and TPOT ({presets}; default %(default)s, GPU figures)")  # fmt: skip
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO in ms (default: the preset's)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO in ms (default: the preset's)")
    p.add_argument("--slo-attainment", type=float, default=0.9, help="share that must meet both (default 0.9)")
    p.add_argument("--json", help="write the results here (after each run)")
    p.add_argument("--append", action="store_true", help="add this invocation's runs to the --json file's")
    p.add_argument("--plots", help="write latency_cdf.png and sweep.png into this directory")
    p.add_argument("--label", default="", help="a name for these results (plots, JSON)")
    p.add_argument("--save-token-times", action="store_true", help="keep every chunk's arrival time in the JSON")
    p.add_argument("--seed", type=int, default=0, help="arrivals and lengths (default 0)")
    p.add_argument("--prompt-seed", type=int, default=None, help="prompt contents (default: random, never cached)")
    p.add_argument("--workers", type=int, default=0, help="client processes (default: one per 4 cores, at most 8)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, seconds")
    p.add_argument("--retry", action="store_true", help="retry RESOURCE_EXHAUSTED (default: count it as an error)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default greedy)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def slo_of(args: argparse.Namespace) -> SLO:
    """The SLO of the flags: --slo-ttft-ms / --slo-tpot-ms where given, else the preset's figures."""
    ttft, tpot = SLO_PRESETS[args.slo_preset]
    return SLO(
        ttft if args.slo_ttft_ms is None else args.slo_ttft_ms,
        tpot if args.slo_tpot_ms is None else args.slo_tpot_ms,
        args.slo_attainment,
    )


def slo_lines(runs: list[dict[str, Any]], best: float | None, slo: SLO, preset: str) -> list[str]:
    """What the runs say about the SLO: the highest rate meeting it, and a plain line when no run met it."""
    what = f"TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms"
    lines = []
    if any(r.get("rate") is not None for r in runs):
        best_text = "none" if best is None else f"{best:g} req/s"
        lines.append(f"highest rate with >= {slo.attainment:.0%} of requests meeting {what}: {best_text}")
    met = [r for r in runs if (r["summary"]["slo_attainment"] or 0.0) >= slo.attainment - 1e-12]
    if runs and not met:
        kind = "rate" if all(r.get("rate") is not None for r in runs) else "run"
        hint = "raise --slo-ttft-ms / --slo-tpot-ms" if preset == "cpu" else "on CPU try --slo-preset cpu or raise them"
        lines.append(f"no {kind} met the SLO ({what} for >= {slo.attainment:.0%} of requests; {hint})")
    return lines


def lag_warning(run: dict[str, Any], workers: int) -> str | None:
    """A warning when open-loop requests left the client late (p99 past LAG_WARN_MS), naming the likely cause: the
    client processes' own reading (many tokens/s each: more --workers help) or a CPU the client shares with busy
    processes (few tokens/s each: more workers would not help)."""
    lag = run["summary"]["client_lag_ms"]["p99"]
    if lag is None or lag <= LAG_WARN_MS:
        return None
    per_worker = (run["summary"]["output_tokens_per_s"] or 0.0) / max(1, workers)
    head = f"warning ({load_label(run)}): requests left the client {lag:.0f} ms late (p99)"
    if per_worker > WORKER_TOKENS_PER_S:
        return f"{head}: each of the {workers} client processes read {per_worker:.0f} tokens/s: raise --workers"
    return (
        f"{head} while each client process read only {per_worker:.0f} tokens/s: the client was short of CPU "
        f"(the server on the same cores?), not of workers; run it on other cores or another host, and read "
        f"latencies as including up to that delay"
    )


def _command(argv: list[str]) -> str:
    """The command line, with the token's value masked."""
    out, hide = [], False
    for a in argv:
        out.append("***" if hide else a.split("=")[0] + "=***" if a.startswith("--token=") else a)
        hide = a == "--token"
    return shlex.join(["pdserve", "bench", *out])


def _runs(args: argparse.Namespace, vocab: Vocabulary) -> list[tuple[dict[str, Any], Load]]:
    """(what the run is, its load) per run, in order; checks the lengths fit the model's context."""
    n = args.num_requests if args.num_requests is not None or args.duration is not None else 200
    if n is not None and n < 1:
        raise ValueError("--num-requests must be >= 1")
    runs: list[tuple[dict[str, Any], Load]] = []
    if args.trace:
        specs = load_trace(args.trace)
        if args.duration is not None:
            specs = [s for s in specs if (s.arrival_s or 0.0) < args.duration]
        specs = specs[: args.num_requests] if args.num_requests is not None else specs  # default: the whole trace
        runs.append(({"rate": None, "concurrency": None, "trace": args.trace}, Load(specs, total=len(specs))))
        longest = max(s.input_tokens + s.output_tokens for s in specs)
    else:
        longest = args.input_dist.max + args.output_dist.max
        for rate in sorted(args.rates or args.rate or []):
            specs = open_loop_specs(rate, args.input_dist, args.output_dist, args.seed, n, args.duration)
            runs.append(({"rate": rate, "concurrency": None}, Load(specs, total=len(specs))))
        for c in args.concurrency or []:
            stream = SpecStream(args.input_dist, args.output_dist, args.seed, n)
            runs.append(({"rate": None, "concurrency": c}, Load(stream, c, args.duration, total=n)))
    if vocab.max_model_len is not None and longest > vocab.max_model_len:
        raise ValueError(
            f"a request may need {longest} tokens (prompt + output) but the model's context is "
            f"{vocab.max_model_len}: its output would be cut short; lower the distributions' maxima"
        )
    return runs


def _progress(total: int | None, desc: str, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=disable, mininterval=0.5, leave=True)


def _warmup(args, runs: list[tuple[dict[str, Any], Load]], prompts: PromptMaker, opts: ClientOptions) -> dict[str, Any]:
    """`--warmup` requests, 8 at a time, not measured: lengths from the trace (its first ones, cycled) or the laws."""
    import asyncio

    if args.warmup <= 0:
        return {"requests": 0, "errors": {}}
    if args.trace:
        trace = list(runs[0][1].specs)
        specs = [RequestSpec(i, trace[i % len(trace)].input_tokens, trace[i % len(trace)].output_tokens)
                 for i in range(args.warmup)]  # fmt: skip
    else:
        specs = list(SpecStream(args.input_dist, args.output_dist, args.seed + 1, args.warmup))
    with _progress(args.warmup, "warm-up", args.no_progress) as bar:
        records = asyncio.run(run_load(Load(specs, min(args.warmup, 8)), prompts.for_run(0), opts, None, bar.update))
    s = summarize(records, SLO())
    return {"requests": len(records), "errors": s["errors"], "error_examples": s["error_examples"]}


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`--append`: the old document's runs and the new ones, by load, the sweep recomputed. The SLO must agree."""
    if old.get("schema") != SCHEMA:
        raise ValueError(f"not a pdserve bench result (schema {old.get('schema')!r})")
    if old["slo"] != new["slo"]:
        raise ValueError(f"the SLO differs from the file's ({old['slo']} vs {new['slo']})")
    out = dict(new)
    out["runs"] = sorted(
        [*old["runs"], *new["runs"]], key=lambda r: (r.get("rate") or math.inf, r.get("concurrency") or 0)
    )
    out["command"] = [*_as_list(old["command"]), *_as_list(new["command"])]
    out["sweep"] = sweep(out["runs"], SLO(**old["slo"]))
    return out


def _as_list(x: str | list[str]) -> list[str]:
    return x if isinstance(x, list) else [x]


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def cmd_bench(argv: list[str]) -> int:
    if argv and argv[0] == "plot":
        return cmd_plot(argv[1:])
    p = parser()
    args = p.parse_args(argv)
    try:
        vocab = Vocabulary.from_model_dir(args.tokenizer) if args.tokenizer else Vocabulary.from_size(args.vocab_size)
        runs = _runs(args, vocab)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if args.append and not args.json:
        p.error("--append needs --json")
    workers = args.workers or max(1, min(8, (os.cpu_count() or 1) // 4))
    slo = slo_of(args)
    opts = ClientOptions(args.target, args.timeout, args.retry, args.temperature, **client_options(args))
    prompts = PromptMaker.fresh(vocab, args.prompt_seed)
    old = None
    if args.append and Path(args.json).exists():
        try:
            old = json.loads(Path(args.json).read_text())
            merge(old, {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "attainment": slo.attainment},
                        "command": "", "runs": []})  # fmt: skip
        except (ValueError, KeyError) as e:
            p.error(f"--append to {args.json}: {e}")
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "label": args.label,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": _command(argv),
        "target": args.target,
        "workload": {
            "input_dist": None if args.trace else str(args.input_dist),
            "output_dist": None if args.trace else str(args.output_dist),
            "trace": args.trace,
            "num_requests": args.num_requests,
            "duration_s": args.duration,
            "seed": args.seed,
            "prompt_nonce": prompts.nonce,
            "vocabulary": vocab.source,
            "temperature": args.temperature,
        },
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "attainment": slo.attainment},
        "client": {
            "workers": workers,
            "timeout_s": args.timeout,
            "retry": args.retry,
            "tls": bool(opts.tls or opts.tls_ca),
        },
        "warmup": {},
        "runs": [],
        "sweep": {"rows": [], "max_rate_meeting_slo": None},
    }
    try:
        doc["warmup"] = _warmup(args, runs, prompts, opts)
        if args.warmup > 0 and doc["warmup"]["errors"] and sum(doc["warmup"]["errors"].values()) == args.warmup:
            print(f"error: every warm-up request failed: {doc['warmup']['error_examples']}", file=sys.stderr)
            return 1
        for k, (what, load) in enumerate(runs, start=1):
            with _progress(load.total, load_label(what), args.no_progress) as bar:
                records = run_workers(load, prompts.for_run(k), opts, workers, bar.update)
            run = {
                **what,
                "summary": summarize(records, slo),
                "requests": request_rows(records, slo, args.save_token_times),
            }
            doc["runs"].append(run)
            doc["sweep"] = sweep(doc["runs"], slo)
            if args.json:
                _write(Path(args.json), merge(old, doc) if old else doc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    final = merge(old, doc) if old else doc
    print(table(final["runs"]))
    for line in slo_lines(final["runs"], final["sweep"]["max_rate_meeting_slo"], slo, args.slo_preset):
        print(line)
    for run in doc["runs"]:
        if (warning := lag_warning(run, workers)) is not None:
            print(warning)
    for run in final["runs"]:
        if run["summary"]["errors"]:
            print(f"errors ({load_label(run)}): {run['summary']['errors']} e.g. {run['summary']['error_examples']}")
    if args.plots:
        from pdserve.bench.plots import write_plots

        for path in write_plots([(args.label, final)], args.plots):
            print(f"wrote {path}")
    if args.json:
        print(f"wrote {args.json}")
    return 1 if all(r["summary"]["completed"] == 0 for r in doc["runs"]) else 0


def cmd_plot(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench plot", description="Draw the plots of saved bench results.")
    p.add_argument("results", nargs="+", help="JSON files written by pdserve bench --json")
    p.add_argument("--labels", default=None, help="comma-separated, one per file (default: each file's label)")
    p.add_argument("--out", required=True, help="directory for latency_cdf.png and sweep.png")
    args = p.parse_args(argv)
    docs = [json.loads(Path(f).read_text()) for f in args.results]
    labels = (
        args.labels.split(",") if args.labels else [d.get("label") or Path(f).stem for d, f in zip(docs, args.results)]
    )
    if len(labels) != len(docs):
        p.error("--labels needs one label per file")
    from pdserve.bench.plots import write_plots

    for path in write_plots(list(zip(labels, docs)), args.out):
        print(f"wrote {path}")
    return 0
