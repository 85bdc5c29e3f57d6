"""Goodput of the split against colocated serving on two GPUs (issue 15): the same router, API and load
(`pdserve bench`) against (a) prefill on GPU0 + decode on GPU1 and (b) two colocated instances, one per GPU.

    python bench/goodput.py [--rates 2,4,8,12,16] [--num-requests 80] [--json docs/bench/goodput.json]
        [--plots docs/bench/goodput]

8B Llama-shaped random bf16 checkpoint, int8 KV, inputs lognormal around 1.5k tokens (up to 4k), outputs around
256 (up to 512), fresh prompts, exact output lengths. Per mode: a rate sweep; goodput = the highest rate at which
at least 90% of requests meet TTFT <= 350 ms and TPOT <= 15 ms. Where time goes comes from the services' own
spans (OTLP to an in-process receiver): queue (router span start -> decode span start), prefill (sum of prefill
chunk spans), KV transfer (last prefill chunk's end -> decode's KV receive end: the part not hidden under
compute), decode (KV receive end -> decode span end).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchutil import log, merge_json, pdserve_bench, percentile, provenance

from pdserve.cli.launch import start_stack
from pdserve.testing.otlp_sink import OTLPSink

SLO_TTFT_MS, SLO_TPOT_MS = 350.0, 15.0
INPUT_DIST, OUTPUT_DIST = "lognormal:1500,0.5,4096", "lognormal:256,0.5,512"


def where_time_goes(sink: OTLPSink) -> dict:
    """Per request (one trace each), ms: queue, prefill compute, exposed KV transfer, decode; medians and p90."""
    traces: dict[str, list] = {}
    spans_all = sink.spans()
    for sp in spans_all:
        traces.setdefault(sp.trace_id, []).append(sp)
    log(f"spans: {len(spans_all)} in {len(traces)} traces ({', '.join(sorted({s.name for s in spans_all}))})")
    rows: dict[str, list[float]] = {"queue": [], "prefill": [], "kv_transfer": [], "kv_ship": [], "decode": []}
    for spans in traces.values():
        by = lambda name: [s for s in spans if s.name == name]
        root = by("router.generate")
        if by("colocated.request"):  # colocated: one span for the request, one for its prompt's chunks
            dec, pre = by("colocated.request"), by("colocated.prefill")
            if root:
                rows["queue"].append((dec[0].start_ns - root[0].start_ns) / 1e6)
            if pre:
                rows["prefill"].append((pre[0].end_ns - pre[0].start_ns) / 1e6)
                rows["decode"].append((dec[0].end_ns - pre[0].end_ns) / 1e6)
            continue
        dec, recv, chunks = by("decode.request"), by("decode.kv_receive"), by("prefill.chunk")
        if not root or not dec:
            continue
        rows["queue"].append((dec[0].start_ns - root[0].start_ns) / 1e6)
        if chunks:
            rows["prefill"].append(sum(c.end_ns - c.start_ns for c in chunks) / 1e6)
        if recv and chunks:
            rows["kv_transfer"].append(max(0, recv[0].end_ns - max(c.end_ns for c in chunks)) / 1e6)
            rows["decode"].append((dec[0].end_ns - recv[0].end_ns) / 1e6)
        ship = by("prefill.kv_ship")
        if ship:
            rows["kv_ship"].append((ship[0].end_ns - ship[0].start_ns) / 1e6)
    return {k: {"p50": percentile(v, 50), "p90": percentile(v, 90), "n": len(v)} for k, v in rows.items() if v}


def goodput_rate(result: dict) -> float:
    """Highest swept rate at which >= 90% of requests met both SLOs (0 when none did)."""
    return float(result["sweep"]["max_rate_meeting_slo"] or 0.0)


def at_rate(result: dict, rate: float) -> dict:
    return next((r["summary"] for r in result["runs"] if r["rate"] == rate), {})


def run_mode(name: str, model: Path, workdir: Path, args, sink: OTLPSink, colocated: bool) -> dict:
    extra = ["--max-num-seqs", str(args.max_num_seqs), "--request-timeout-s", "120"]
    log(f"{name}: starting the stack")
    t0 = time.perf_counter()
    gpus = [0, 1] if torch.cuda.device_count() >= 2 else None  # CPU: a smoke run of this script
    stack = start_stack(
        model, workdir / name, kv_dtype="int8", gpus=gpus, extra=extra, timeout=900,
        num_colocated=2 if colocated else 0,
    )  # fmt: skip
    log(f"{name}: stack up in {time.perf_counter() - t0:.0f}s (router {stack.router})")
    try:
        sink.clear()
        res = pdserve_bench(stack.router, workdir / f"{name}.json", "--tokenizer", str(model), "--rates", args.rates,
                            "--num-requests", str(args.num_requests), "--input-dist", args.input_dist, "--output-dist",
                            args.output_dist, "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms", str(SLO_TPOT_MS),
                            "--seed", str(args.seed))  # fmt: skip
    finally:
        stack.stop()  # each service flushes its batched spans as it stops
    res["where_time_goes"] = where_time_goes(sink)
    for r in res["runs"]:
        s = r["summary"]
        log(
            f"{name} rate {r['rate']}: SLO met {s['slo_attainment']:.0%}, TTFT p90 {s['ttft_ms']['p90']:.0f} ms, "
            f"TPOT p90 {s['tpot_ms']['p90']:.1f} ms, {s['output_tokens_per_s']:.0f} tok/s, errors {s['errors']}"
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rates", default="2,4,8,12,16,24")
    ap.add_argument("--num-requests", type=int, default=80)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "pdserve-goodput"))
    ap.add_argument("--json", default="docs/bench/goodput.json")
    ap.add_argument("--plots", default="docs/bench/goodput")
    ap.add_argument("--modes", default="disagg,colocated")
    ap.add_argument("--commit", default="")
    ap.add_argument("--model", default="", help="an existing model directory instead of the random 8B checkpoint")
    ap.add_argument("--input-dist", default=INPUT_DIST)
    ap.add_argument("--output-dist", default=OUTPUT_DIST)
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else workdir / f"llama8b-{args.layers}l"
    if not args.model and not (model / "model.safetensors.index.json").exists():
        from pdserve.models.random_llama import write_random_llama

        write_random_llama(model, args.layers, device="cuda:0")
    results: dict[str, dict] = {}
    with OTLPSink() as sink:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint  # the services inherit it
        for mode in args.modes.split(","):
            results[mode] = run_mode(mode, model, workdir, args, sink, colocated=mode == "colocated")
    if args.plots:  # pdserve bench's own plots of the runs it saved
        paths = [str(workdir / f"{m}.json") for m in results]
        cmd = [sys.executable, "-m", "pdserve.cli", "bench", "plot", *paths, "--labels", ",".join(results)]
        subprocess.run([*cmd, "--out", args.plots], check=False)
    device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    out: dict = dict(**provenance(args.commit, device), slo_ttft_ms=SLO_TTFT_MS, slo_tpot_ms=SLO_TPOT_MS)
    out.update(input_dist=args.input_dist, output_dist=args.output_dist, num_requests_per_rate=args.num_requests)
    if "disagg" in results:
        out["disagg_goodput_rps"] = goodput_rate(results["disagg"])
        kv = results["disagg"]["where_time_goes"].get("kv_transfer", {})
        out["kv_transfer_ms_p50"] = kv.get("p50", float("nan"))
    if "colocated" in results:
        out["colocated_goodput_rps"] = goodput_rate(results["colocated"])
    if len(results) == 2:
        rate = out["colocated_goodput_rps"] or min(r["rate"] for r in results["colocated"]["runs"])
        out["compared_at_rate"] = rate
        out["disagg_tpot_ms_p90"] = at_rate(results["disagg"], rate).get("tpot_ms", {}).get("p90", float("nan"))
        out["colocated_tpot_ms_p90"] = at_rate(results["colocated"], rate).get("tpot_ms", {}).get("p90", float("nan"))
    sweep = lambda r: [{"rate": s["rate"], "summary": s["summary"]} for s in r["runs"]]
    out["details"] = {m: {"where_time_goes": r["where_time_goes"], "sweep": sweep(r)} for m, r in results.items()}
    merge_json(args.json, out)
    print(json.dumps({k: v for k, v in out.items() if k != "details"}, indent=1))
    for m, r in results.items():
        log(f"{m}: where time goes (ms, p50 / p90): " + ", ".join(
            f"{k} {v['p50']:.1f} / {v['p90']:.1f} (n={v['n']})" for k, v in r["where_time_goes"].items()))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
