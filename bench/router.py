"""Router: PCS routing vs round-robin vs least-requests on a skewed workload, end to end, and the router's decision
overhead per request (the keys of docs/bench/router.json). The output-length estimator's error on a synthetic
workload is printed by `pytest tests/services/router/test_estimator.py -s`.

    python bench/router.py [--requests 24] [--rate 2.0] [--long-frac 0.25] [--rounds 4] [--warmup-rounds 1]
                           [--json docs/bench/router.json]

Scaled for a 2-core CPU: the tiny random-weight llama (2 layers, hidden 64) with max_position_embeddings 8192,
2 prefill + 2 decode processes (--torch-threads 1 each) and one router per variant (the three policies, plus
PCS without its dispatch gate), all on loopback. The workload is open-loop Poisson arrivals of 32-token and
4096-token prompts (random tokens, no shared prefix, new tokens every run so the prompt cache never hits) with
max_tokens drawn from {16, 64, 256} (short) / {16, 64} (long), ignore_eos (so the output length is max_tokens),
replayed by `pdserve bench --trace`. Every variant gets the same arrival times, lengths and max_tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchutil import log, merge_json, pdserve_bench, provenance

from pdserve.bench.report import column
from pdserve.cli.launch import start_service, start_stack, wait_ready
from pdserve.models.checkpoints import build_checkpoint

POLICIES = ("pcs", "round_robin", "least_requests")


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (nan for no values)."""
    s = sorted(xs)
    return s[max(0, -(-len(s) * q // 100) - 1)] if s else float("nan")


# ---- decision overhead ----------------------------------------------------------------------------------------
def decision_overhead(model: Path, n: int = 5000, n_inst: int = 8) -> dict[str, dict[str, float]]:
    """In-process: plan (special tokens, estimator, PCS, page hash) + submit (admission, queue, policy picks)
    per request, `n_inst` prefill and decode instances, ~16 requests kept in flight."""
    from transformers import AutoTokenizer

    from pdserve.router.config import RouterConfig
    from pdserve.router.instances import DECODE, PREFILL
    from pdserve.router.priority import Priority
    from pdserve.router.servicer import RouterServicer

    tok = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 512) for _ in range(4096 if rng.random() < 0.2 else 32)] for _ in range(200)]
    res = {}
    for policy in POLICIES:
        cfg = RouterConfig(model=str(model), policy=policy, estimator_store="memory")
        sv = RouterServicer(cfg, tok, max_model_len=8192, vocab_size=512)
        for k in range(n_inst):  # prefill rates high enough that admission never refuses: only the decision counts
            sv.scheduler.observe_page_size(sv.scheduler.add(PREFILL, f"10.0.0.{k}:1"), 16, prefill_tokens_per_s=1e6)
            d = sv.scheduler.add(DECODE, f"10.0.1.{k}:1")
            sv.scheduler.update_stats(d, pages_free=8000, pages_total=8192, active=4)
        held, plan_us, sched_us = [], [], []
        for i in range(n):
            ids = prompts[i % len(prompts)]
            t0 = time.perf_counter_ns()
            plan = sv.plan(str(i), ids, 64, Priority.NORMAL, page_size=16)
            t1 = time.perf_counter_ns()
            sv.scheduler.submit(plan.job)
            t2 = time.perf_counter_ns()
            plan_us.append((t1 - t0) / 1e3)
            sched_us.append((t2 - t1) / 1e3)
            held.append(plan.job)
            if len(held) > 16:
                j = held.pop(0)
                sv.scheduler.first_token(j)
                sv.scheduler.finish(j, completed=True)
        total = [a + b for a, b in zip(plan_us, sched_us)]
        res[policy] = {f"{k}_p{q}": pct(v, q) for k, v in (("plan", plan_us), ("sched", sched_us)) for q in (50, 99)}
        res[policy] |= {"p50": pct(total, 50), "p99": pct(total, 99)}
        log(f"decision overhead per request, {policy} ({n_inst} + {n_inst} instances, 20% 4096-token prompts): "
            + ", ".join(f"{k} {v:.1f} us" for k, v in res[policy].items()))  # fmt: skip
    return res


# ---- end to end -------------------------------------------------------------------------------------------------
def write_trace(path: Path, n: int, rate: float, long_frac: float, seed: int) -> Path:
    """A `pdserve bench --trace` file: Poisson arrivals, 4096-token prompts with probability `long_frac` (else 32),
    max_tokens from {16, 64} (long) / {16, 64, 256} (short); the same for every variant of a seed. pdserve bench
    draws fresh prompt tokens per invocation, so the prefill prompt cache never serves a run from an earlier one."""
    rng, t, lines = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < long_frac
        out = rng.choice([16, 64] if long else [16, 64, 256])
        lines.append(json.dumps({"arrival_s": round(t, 4), "input_tokens": 4096 if long else 32, "output_tokens": out}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run_workload(router: str, model: Path, trace: Path, out: Path) -> dict:
    """One round of `trace` against `router` through pdserve bench: TTFT percentiles, short and long P99."""
    run = pdserve_bench(router, out, "--tokenizer", str(model), "--trace", str(trace), "--warmup", "0",
                        "--slo-ttft-ms", "100000", "--slo-tpot-ms", "100000")["runs"][0]  # fmt: skip
    s = run["summary"]
    ttft, lens = column(run, "ttft_ms"), column(run, "input_tokens")
    by_len = lambda long: [t for t, n in zip(ttft, lens) if t is not None and (n > 32) == long]
    return dict(p50=s["ttft_ms"]["p50"], p99=s["ttft_ms"]["p99"], short_p99=pct(by_len(False), 99),
                long_p99=pct(by_len(True), 99), tok_s=s["output_tokens_per_s"], req_s=s["throughput_rps"],
                errors=s["num_requests"] - s["completed"], ttfts=[t for t in ttft if t is not None])  # fmt: skip


# router flags per variant; the baselines dispatch at once like a plain proxy (no dispatch gate)
VARIANTS = {
    "pcs": ["--policy", "pcs"],
    "round_robin": ["--policy", "round_robin", "--prefill-max-inflight-tokens", "0"],
    "least_requests": ["--policy", "least_requests", "--prefill-max-inflight-tokens", "0"],
    "pcs_no_gate": ["--policy", "pcs", "--prefill-max-inflight-tokens", "0"],
}


def end_to_end(model: Path, work_dir: Path, args) -> dict[str, dict]:
    base, names = ["--estimator-store", "memory"], list(VARIANTS)
    stack = start_stack(model, work_dir / "stack", num_prefill=2, num_decode=2, extra=["--torch-threads", "1"],
                        router_extra=[*base, *VARIANTS[names[0]]])  # fmt: skip
    routers = {names[0]: stack.router}
    runs: dict[str, list[dict]] = {n: [] for n in names}
    trace = write_trace(work_dir / "trace.jsonl", args.requests, args.rate, args.long_frac, args.seed)
    try:
        pairs = [("--prefill", a) for a in stack.prefill] + [("--decode", a) for a in stack.decode]
        static = [f for pair in pairs for f in pair]
        for name in names[1:]:
            rargs = ["--model", str(model), *static, *base, *VARIANTS[name]]
            r = start_service("router", rargs, work_dir / "stack", env={"PDSERVE_INTERNAL_TOKEN": stack.internal_token})
            stack.procs.append(r[0])
            stack.logs.append(r[2])
            routers[name] = wait_ready(*r)
        warm = write_trace(work_dir / "warm.jsonl", args.requests, args.rate, args.long_frac, args.seed + 1)
        for _ in range(args.warmup_rounds):  # unmeasured rounds: first calls, first allocations
            for name in names[::-1]:
                run_workload(routers[name], model, warm, work_dir / "warm.json")
        log(f"end to end: {args.requests} requests per round, Poisson {args.rate}/s, {args.long_frac:.0%} of 4096 "
            f"tokens, 2 prefill + 2 decode, {args.rounds} round(s); load average {os.getloadavg()[0]:.1f}")  # fmt: skip
        for rnd in range(args.rounds):  # rotate the order: background load drifts, every variant sees each slot
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                r = run_workload(routers[name], model, trace, work_dir / f"{name}-{rnd}.json")
                runs[name].append(r)
                log(f"round {rnd} {name:15s} TTFT p50 {r['p50']:7.0f} ms, p99 {r['p99']:7.0f} ms, {r['tok_s']:6.1f} "
                    f"tok/s, errors {r['errors']} (load {os.getloadavg()[0]:.1f})")  # fmt: skip
    finally:
        stack.stop()
    out = {}
    print(f"\n{'variant':>15s} {'p99 median':>10s} {'p99 pooled':>10s} {'p50 pooled':>10s} {'short p99':>9s} "
          f"{'long p99':>9s} {'tok/s':>7s} {'req/s':>6s} {'errors':>6s}   (TTFT ms)")  # fmt: skip
    for name, rs in runs.items():
        ttft = [t for r in rs for t in r["ttfts"]]
        med = lambda k, rs=rs: statistics.median(r[k] for r in rs)
        o = out[name] = dict(p99_median=med("p99"), p99=pct(ttft, 99), p50=pct(ttft, 50), short_p99=med("short_p99"),
                             long_p99=med("long_p99"), tok_s=med("tok_s"), req_s=med("req_s"),
                             errors=sum(r["errors"] for r in rs))  # fmt: skip
        print(f"{name:>15s} {o['p99_median']:10.0f} {o['p99']:10.0f} {o['p50']:10.0f} {o['short_p99']:9.0f} "
              f"{o['long_p99']:9.0f} {o['tok_s']:7.1f} {o['req_s']:6.2f} {o['errors']:6d}")  # fmt: skip
    print("p99 median: the median over rounds of each round's P99 (robust to a round disturbed by other work on the "
          "host); short/long p99, tok/s, req/s: medians over rounds")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="requests per round")
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    ap.add_argument("--long-frac", type=float, default=0.25, help="fraction of 4096-token prompts")
    ap.add_argument("--rounds", type=int, default=4, help="repeat the workload per variant (rotating the order)")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="unmeasured rounds of every variant first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-e2e", action="store_true", help="only the in-process figures")
    ap.add_argument("--json", default="", help="merge the figures (docs/bench/router.json keys) into this file")
    ap.add_argument("--commit", default="", help="the commit measured (a copied tree may lack git)")
    args = ap.parse_args()
    work_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-router-"))
    model = build_checkpoint(work_dir / "model", arch="llama", seed=0, max_position_embeddings=8192)
    dec = decision_overhead(model)
    if args.skip_e2e:
        return
    e2e = end_to_end(model, work_dir, args)
    if args.json:
        figures = {f"p99_ttft_ms_{p}": round(e2e[p]["p99_median"], 1) for p in POLICIES}
        merge_json(args.json, {**figures, "decision_us_p99": round(dec["pcs"]["p99"], 1), **provenance(args.commit)})


if __name__ == "__main__":
    main()
