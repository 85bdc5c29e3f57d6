"""Router benchmark: PCS routing vs round-robin vs least-requests on a skewed workload (end to end, and simulated:
the real scheduler against FIFO prefill instances, free of CPU noise), the router's decision overhead, and the
output-length estimator's error on a synthetic workload with known structure.

    python bench/router.py [--requests 24] [--rate 2.0] [--long-frac 0.25] [--rounds 4] [--warmup-rounds 1]
                           [--json docs/bench/router.json]

Scaled for a 2-core CPU: the tiny random-weight llama (2 layers, hidden 64) with max_position_embeddings 8192,
2 prefill + 2 decode processes (--torch-threads 1 each) and one router per variant (the three policies, plus
PCS without its dispatch gate), all on loopback. The workload is open-loop Poisson arrivals of 32-token and
4096-token prompts (random tokens, no shared prefix, new tokens every run so the prompt cache never hits) with
max_tokens drawn from {16, 64, 256} (short) / {16, 64} (long), ignore_eos (so the output length is max_tokens).
Every variant gets the same arrival times, lengths and max_tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import random
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import grpc

import pdserve
from pdserve.cli.launch import start_service, start_stack, wait_ready
from pdserve.models.checkpoints import build_checkpoint

POLICIES = ("pcs", "round_robin", "least_requests")


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


# ---- estimator error ------------------------------------------------------------------------------------------
def estimator_error(n: int = 4000, warmup: int = 1000) -> dict[str, float]:
    from pdserve.router.estimator import OutputLengthEstimator, features
    from pdserve.router.pcs import count_special, fallback_output_len
    from pdserve.testing.synthetic import rel_error, workload

    special = frozenset(range(5))
    est = OutputLengthEstimator()
    rows: dict[str, list[tuple[float, float]]] = {"learned": [], "length_only": [], "max_tokens": [], "oracle": []}
    for i, s in enumerate(workload(n, seed=11)):
        f = features(s.token_ids, special, count_special(s.token_ids, special))
        p = est.predict(f, s.max_tokens)
        lo = fallback_output_len(s.max_tokens, len(s.token_ids), "length_only")
        if i >= warmup:
            for name, guess in (
                ("learned", p if p is not None else lo),
                ("length_only", lo),
                ("max_tokens", s.max_tokens),
                ("oracle", s.oracle),
            ):
                rows[name].append((rel_error(guess, s.output_len), abs(guess - s.output_len)))
        est.observe(f, s.output_len, p)
    print(
        f"\nOutput-length estimator on a synthetic workload ({n} requests, 8 tasks, lognormal noise sigma=0.3; "
        f"errors over the last {n - warmup}):"
    )
    print(f"{'predictor':>12s} {'rel. error':>10s} {'MAE tokens':>10s}")
    out = {}
    for name, r in rows.items():
        out[name] = statistics.mean(e for e, _ in r)
        print(f"{name:>12s} {out[name]:10.3f} {statistics.mean(a for _, a in r):10.1f}")
    print(
        f"running error the router sees: {est.error:.3f} (fallback above {est.max_error}); mode "
        f"{est.mode('length_only')}"
    )
    return out


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
    print(
        f"\nDecision overhead per request (in-process, {n_inst} prefill + {n_inst} decode instances, "
        f"20% 4096-token / 80% 32-token prompts, {n} requests):"
    )
    print(
        f"{'policy':>15s} {'plan p50':>9s} {'plan p99':>9s} {'sched p50':>9s} {'sched p99':>9s} "
        f"{'total p50':>9s} {'total p99':>9s}  (µs)"
    )
    for policy in POLICIES:
        cfg = RouterConfig(model=str(model), policy=policy, estimator_store="memory")
        sv = RouterServicer(cfg, tok, max_model_len=8192, vocab_size=512)
        for k in range(n_inst):
            sv.scheduler.add(PREFILL, f"10.0.0.{k}:1")
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
        res[policy] = {
            "plan_p50": pct(plan_us, 50),
            "plan_p99": pct(plan_us, 99),
            "sched_p50": pct(sched_us, 50),
            "sched_p99": pct(sched_us, 99),
            "p50": pct(total, 50),
            "p99": pct(total, 99),
        }
        r = res[policy]
        print(
            f"{policy:>15s} {r['plan_p50']:9.1f} {r['plan_p99']:9.1f} {r['sched_p50']:9.1f} {r['sched_p99']:9.1f} "
            f"{r['p50']:9.1f} {r['p99']:9.1f}"
        )
    return res


# ---- simulated instances --------------------------------------------------------------------------------------
def simulate(
    policy: str,
    rate: float,
    long_frac: float,
    n: int = 2000,
    seed: int = 0,
    n_prefill: int = 2,
    long_s: float = 1.4,
    short_s: float = 0.012,
    largest_first: bool = False,
) -> list[tuple[float, bool]]:
    """The real Scheduler and policy against simulated prefill instances (each a FIFO server: a 4096-token
    prompt takes `long_s`, a 32-token one `short_s`), Poisson arrivals. Returns (TTFT s, is_long) per request.
    Baselines dispatch at once (no gate), like the end-to-end runs. `largest_first`: the queue ordered by
    largest PCS first (the alternative reading of the priority rule, for comparison)."""
    import heapq
    import itertools

    from pdserve.router.config import RouterConfig
    from pdserve.router.instances import DECODE, PREFILL
    from pdserve.router.scheduler import Job, Scheduler

    cfg = RouterConfig(
        model="m",
        policy=policy,
        prefill_capacity_pcs=1e9,
        decode_capacity_pcs=1e9,
        max_queue=10**6,
        **({} if policy == "pcs" else {"prefill_max_inflight_tokens": 0}),
    )
    sched = Scheduler(cfg)
    for i in range(n_prefill):
        sched.add(PREFILL, f"p{i}:1")
    sched.add(DECODE, "d:1")
    rng, seq, t, events = random.Random(seed), itertools.count(), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        heapq.heappush(events, (t, next(seq), "arrive", 4096 if rng.random() < long_frac else 32))
    fifo: dict[str, list[Job]] = {a: [] for a in sched.instances[PREFILL]}
    busy = dict.fromkeys(fifo, False)
    waiting: list[Job] = []
    out = []

    def start(addr: str, now: float) -> None:
        if fifo[addr] and not busy[addr]:
            busy[addr] = True
            heapq.heappush(
                events, (now + (long_s if fifo[addr][0].prompt_len > 32 else short_s), next(seq), "done", addr)
            )

    while events:
        now, _, kind, x = heapq.heappop(events)
        if kind == "arrive":
            pcs = 0.3 * x + 0.5 * 32
            job = Job(str(now), pcs, -pcs if largest_first else pcs, x, 1, None, arrival=now)
            sched.submit(job)
            waiting.append(job)
        else:
            job = fifo[x].pop(0)
            busy[x] = False
            out.append((now - job.arrival, job.prompt_len > 32))
            sched.first_token(job)
            sched.finish(job, completed=True)
            start(x, now)
        for job in [j for j in waiting if j.event.is_set()]:  # dispatched by the scheduler: into that FIFO
            waiting.remove(job)
            fifo[job.prefill.address].append(job)
            start(job.prefill.address, now)
    return out


def simulated(loads=((0.5, 0.25), (1.0, 0.25), (2.0, 0.25), (2.5, 0.25), (6.0, 0.05))) -> None:
    print(
        "\nSimulated prefill instances (2 FIFO servers: 4096 tokens 1.4 s, 32 tokens 12 ms, as measured on this CPU; "
        "the real scheduler and policies; 3 seeds x 2000 requests; TTFT = queueing + prefill, ms):"
    )
    print(
        f"{'rate/s':>6s} {'long':>5s} {'util':>5s} {'policy':>15s} {'p50':>6s} {'p99':>6s} {'short p99':>9s} "
        f"{'long p99':>8s}"
    )
    for rate, lf in loads:
        util = rate * (lf * 1.4 + (1 - lf) * 0.012) / 2
        for policy, largest in [(p, False) for p in POLICIES] + [("pcs", True)]:
            res = [simulate(policy, rate, lf, seed=s, largest_first=largest) for s in range(3)]
            f = [[pct([t for t, _ in r], q) for r in res] for q in (50, 99)]
            short = [pct([t for t, lg in r if not lg], 99) for r in res]
            long = [pct([t for t, lg in r if lg], 99) for r in res]
            name = "pcs largest 1st" if largest else policy
            print(
                f"{rate:6.1f} {lf:5.2f} {util:5.2f} {name:>15s} {statistics.mean(f[0]) * 1e3:6.0f} "
                f"{statistics.mean(f[1]) * 1e3:6.0f} {statistics.mean(short) * 1e3:9.0f} "
                f"{statistics.mean(long) * 1e3:8.0f}"
            )


# ---- end to end -----------------------------------------------------------------------------------------------
def make_workload(
    n: int, rate: float, long_frac: float, seed: int, content_seed: int
) -> list[tuple[float, list[int], int]]:
    """Arrival times, prompt lengths and max_tokens from `seed` (the same for every variant); the prompt tokens
    from `content_seed`: every run gets prompts never seen before, so the prefill instances' prompt cache
    (issue 4, on by default) cannot serve a later run from an earlier one."""
    rng, tokens = random.Random(seed), random.Random(content_seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < long_frac
        ids = [tokens.randrange(5, 512) for _ in range(4096 if long else 32)]
        out.append((t, ids, rng.choice([16, 64] if long else [16, 64, 256])))
    return out


def run_workload(router: str, work: list[tuple[float, list[int], int]]) -> dict:
    def one(item):
        at, ids, max_tokens = item
        time.sleep(max(0.0, start + at - time.monotonic()))
        t0 = time.monotonic()
        ttft, n = None, 0
        try:
            for ch in client.stream(token_ids=ids, max_tokens=max_tokens, ignore_eos=True):
                if ttft is None and ch.token_ids:
                    ttft = time.monotonic() - t0
                n += len(ch.token_ids)
        except grpc.RpcError as e:
            return None, 0, time.monotonic(), len(ids), e.code().name
        return ttft, n, time.monotonic(), len(ids), None

    with pdserve.Client(router, timeout=600) as client:
        client.generate(token_ids=[5, 6, 7], max_tokens=2)  # warm the channel
        start = time.monotonic()
        with ThreadPoolExecutor(len(work)) as ex:
            res = list(ex.map(one, work))
    errors = [r[4] for r in res if r[4]]
    ok = [r for r in res if not r[4]]
    ttft = [r[0] * 1e3 for r in ok]
    short = [r[0] * 1e3 for r in ok if r[3] <= 32]
    long = [r[0] * 1e3 for r in ok if r[3] > 32]
    makespan = max(r[2] for r in ok) - start
    return {
        "p50": pct(ttft, 50),
        "p99": pct(ttft, 99),
        "short_p99": pct(short, 99) if short else float("nan"),
        "long_p99": pct(long, 99) if long else float("nan"),
        "tok_s": sum(r[1] for r in ok) / makespan,
        "req_s": len(ok) / makespan,
        "errors": len(errors),
        "ttfts": ttft,
    }


def warm_up(router: str, rounds: int = 4) -> None:
    """Load every instance once before measuring (first calls, first allocations)."""
    rng = random.Random(99)
    with pdserve.Client(router, timeout=600) as c, ThreadPoolExecutor(4) as ex:
        for _ in range(rounds):
            list(
                ex.map(
                    lambda n: c.generate(
                        token_ids=[rng.randrange(5, 512) for _ in range(n)], max_tokens=8, ignore_eos=True
                    ),
                    [4096, 4096, 32, 32],
                )
            )


# router flags per variant; the baselines dispatch at once like a plain proxy (no dispatch gate)
VARIANTS = {
    "pcs": ["--policy", "pcs"],
    "round_robin": ["--policy", "round_robin", "--prefill-max-inflight-tokens", "0"],
    "least_requests": ["--policy", "least_requests", "--prefill-max-inflight-tokens", "0"],
    "pcs_no_gate": ["--policy", "pcs", "--prefill-max-inflight-tokens", "0"],
}


def end_to_end(model: Path, work_dir: Path, args) -> dict[str, dict]:
    base = ["--estimator-store", "memory"]
    names = list(VARIANTS)
    stack = start_stack(
        model,
        work_dir / "stack",
        num_prefill=2,
        num_decode=2,
        extra=["--torch-threads", "1"],
        router_extra=[*base, *VARIANTS[names[0]]],
    )
    routers = {names[0]: stack.router}
    try:
        static = [f for a in stack.prefill for f in ("--prefill", a)] + [
            f for a in stack.decode for f in ("--decode", a)
        ]
        for name in names[1:]:
            r = start_service("router", ["--model", str(model), *static, *base, *VARIANTS[name]], work_dir / "stack")
            stack.procs.append(r[0])
            stack.logs.append(r[2])
            routers[name] = wait_ready(*r)
        warm_up(routers["pcs"])
        content = itertools.count(1000)
        for _ in range(args.warmup_rounds):  # unmeasured rotations
            for name in names[::-1]:
                run_workload(
                    routers[name], make_workload(args.requests, args.rate, args.long_frac, args.seed + 1, next(content))
                )
        n_long = sum(
            1 for _, ids, _ in make_workload(args.requests, args.rate, args.long_frac, args.seed, 0) if len(ids) > 32
        )
        print(
            f"\nEnd to end: {args.requests} requests per round ({n_long} of 4096 tokens, the rest 32), Poisson "
            f"{args.rate}/s, 2 prefill + 2 decode, {args.rounds} round(s); load average {load()}"
        )
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for rnd in range(args.rounds):  # rotate the order: background load drifts, every variant sees each slot
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                work = make_workload(args.requests, args.rate, args.long_frac, args.seed, next(content))
                runs[name].append(run_workload(routers[name], work))
                r = runs[name][-1]
                print(
                    f"  round {rnd} {name:15s} ttft p50 {r['p50']:7.0f} ms  p99 {r['p99']:7.0f} ms  "
                    f"{r['tok_s']:6.1f} tok/s  errors {r['errors']}  (load {load()})",
                    flush=True,
                )
    finally:
        stack.stop()
    out = {}
    print(
        f"\n{'variant':>15s} {'p99 median':>10s} {'p99 pooled':>10s} {'p50 pooled':>10s} {'short p99':>9s} "
        f"{'long p99':>9s} {'tok/s':>7s} {'req/s':>6s} {'errors':>6s}   (TTFT ms)"
    )
    for name, rs in runs.items():
        ttft = [t for r in rs for t in r["ttfts"]]
        out[name] = {
            "p99_median": statistics.median(r["p99"] for r in rs),
            "p99": pct(ttft, 99),
            "p50": pct(ttft, 50),
            "short_p99": statistics.median(r["short_p99"] for r in rs),
            "long_p99": statistics.median(r["long_p99"] for r in rs),
            "tok_s": statistics.median(r["tok_s"] for r in rs),
            "req_s": statistics.median(r["req_s"] for r in rs),
            "errors": sum(r["errors"] for r in rs),
        }
        o = out[name]
        print(
            f"{name:>15s} {o['p99_median']:10.0f} {o['p99']:10.0f} {o['p50']:10.0f} {o['short_p99']:9.0f} "
            f"{o['long_p99']:9.0f} {o['tok_s']:7.1f} {o['req_s']:6.2f} {o['errors']:6d}"
        )
    print(
        "p99 median: the median over rounds of each round's P99 (robust to a round disturbed by other work on "
        "the host); short/long p99, tok/s, req/s: medians over rounds"
    )
    return out


def load() -> str:
    import os

    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="requests per round")
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    ap.add_argument("--long-frac", type=float, default=0.25, help="fraction of 4096-token prompts")
    ap.add_argument("--rounds", type=int, default=4, help="repeat the workload per variant (rotating the order)")
    ap.add_argument("--warmup-rounds", type=int, default=1, help="unmeasured rounds of every variant first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-e2e", action="store_true", help="only the in-process figures")
    ap.add_argument("--json", default="", help="write the figures (docs/bench/router.json keys) here")
    args = ap.parse_args()
    work_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-router-"))
    model = build_checkpoint(work_dir / "model", arch="llama", seed=0, max_position_embeddings=8192)
    estimator_error()
    dec = decision_overhead(model)
    simulated()
    if args.skip_e2e:
        return
    e2e = end_to_end(model, work_dir, args)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "services/router", "bench/router.py"]).returncode:
            commit += "-dirty"
        figures = {f"p99_ttft_ms_{p}": round(e2e[p]["p99_median"], 1) for p in POLICIES}
        figures.update(
            decision_us_p99=round(dec["pcs"]["p99"], 1),
            date=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            commit=commit,
            machine=machine(),
        )
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nwrote {args.json}: {figures}")


if __name__ == "__main__":
    main()
