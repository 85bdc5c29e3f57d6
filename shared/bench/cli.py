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
from pdserve.bench.report import SLO, request_rows, summarize, sweep, table
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
LAG_WARN_MS = 20.0  # open loop: a p99 send delay past this means the client, not the server, set the pace


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
        "`pdserve bench plot RESULT.json...` redraws plots from saved results.",
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
    p.add_argument("--slo-ttft-ms", type=float, default=350.0, help="TTFT SLO (default %(default)s)")
    p.add_argument("--slo-tpot-ms", type=float, default=15.0, help="TPOT SLO (default %(default)s)")
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
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_attainment)
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
    best = final["sweep"]["max_rate_meeting_slo"]
    if any(r["rate"] is not None for r in final["runs"]):
        print(
            f"highest rate with >= {slo.attainment:.0%} of requests meeting TTFT <= {slo.ttft_ms:g} ms and "
            f"TPOT <= {slo.tpot_ms:g} ms: {'none' if best is None else f'{best:g} req/s'}"
        )
    for run in doc["runs"]:
        lag = run["summary"]["client_lag_ms"]["p99"]
        if lag is not None and lag > LAG_WARN_MS:
            print(f"warning ({load_label(run)}): requests left the client {lag:.0f} ms late (p99): raise --workers")
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
