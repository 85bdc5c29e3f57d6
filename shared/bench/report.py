"""Figures of a `pdserve bench` run: per-request latencies, their percentiles, throughput, errors and goodput.

Per request (times from `RequestRecord`):
- TTFT = first token's arrival − send;  E2E = end − send;
- TPOT = (last token's arrival − first token's arrival) / (tokens − 1)  (undefined for one token);
- ITL = the gaps between consecutive chunks that carried tokens (one per gap; the server sends a chunk per step).
A request meets the SLO when it succeeded, TTFT <= slo.ttft_ms and TPOT <= slo.tpot_ms (or it has one token).
Goodput = requests meeting the SLO per second of the run (first send → last end); `slo_attainment` = their share of
all requests, failed ones included. A sweep's `max_rate_meeting_slo` is the highest rate whose attainment reaches
`slo.attainment` (0.9: "90% of requests meet both").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.bench.runner import RequestRecord

PERCENTILES = (50, 90, 99)
REQUEST_COLUMNS = (
    "index",
    "input_tokens",
    "output_tokens",
    "tokens",
    "cached_tokens",
    "status",
    "scheduled_s",
    "send_s",
    "ttft_ms",
    "tpot_ms",
    "e2e_ms",
    "itl_max_ms",
    "server_ttft_ms",
    "meets_slo",
)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = 350.0  # the GPU preset's figures (SLO_PRESETS["gpu"])
    tpot_ms: float = 15.0
    attainment: float = 0.9  # share of requests that must meet both for a rate to count as served


# (TTFT ms, TPOT ms) a run is judged against: `gpu` for a data-centre GPU serving an 8B-class model, `cpu` for the
# small demo model on a few CPU cores (default bench lengths: ~1500-token prompts, ~256-token outputs)
SLO_PRESETS: dict[str, tuple[float, float]] = {"gpu": (350.0, 15.0), "cpu": (5000.0, 150.0)}


def ttft_ms(r: RequestRecord) -> float | None:
    return (r.chunk_s[0] - r.send_s) * 1e3 if r.chunk_s else None


def tpot_ms(r: RequestRecord) -> float | None:
    n = r.tokens
    return (r.chunk_s[-1] - r.chunk_s[0]) * 1e3 / (n - 1) if n >= 2 else None


def e2e_ms(r: RequestRecord) -> float:
    return (r.end_s - r.send_s) * 1e3


def itl_ms(r: RequestRecord) -> np.ndarray:
    return np.diff(np.asarray(r.chunk_s)) * 1e3  # [chunks - 1]


def meets_slo(r: RequestRecord, slo: SLO) -> bool:
    if r.status != "OK" or not r.chunk_s:
        return False
    t = tpot_ms(r)
    return ttft_ms(r) <= slo.ttft_ms and (t is None or t <= slo.tpot_ms)  # type: ignore[operator]


def stats(values: Sequence[float] | np.ndarray) -> dict[str, float | int | None]:
    """count, mean, p50/p90/p99 (linear interpolation), max; None when there are no values."""
    x = np.asarray(values, dtype=np.float64)
    if not len(x):
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    q = np.percentile(x, PERCENTILES)
    return {
        "count": len(x),
        "mean": float(x.mean()),
        **{f"p{p}": float(v) for p, v in zip(PERCENTILES, q)},
        "max": float(x.max()),
    }


def summarize(records: Sequence[RequestRecord], slo: SLO) -> dict[str, Any]:
    """The run's summary: counts, errors by status, throughput, latency stats (ms), goodput."""
    ok = [r for r in records if r.status == "OK"]
    good = sum(meets_slo(r, slo) for r in records)
    start = min((r.send_s for r in records), default=0.0)
    wall = max((r.end_s for r in records), default=0.0) - start
    out_tokens = sum(r.tokens for r in ok)
    itls = np.concatenate([itl_ms(r) for r in ok]) if ok else np.zeros(0)
    lag = [(r.send_s - r.scheduled_s) * 1e3 for r in records if r.scheduled_s is not None]

    def rate(n: int) -> float | None:
        return n / wall if wall > 0 else None

    return {
        "num_requests": len(records),
        "completed": len(ok),
        "errors": dict(sorted(Counter(r.status for r in records if r.status != "OK").items())),
        "error_examples": {r.status: r.error[:300] for r in records if r.status != "OK"},  # one per status
        "short_outputs": sum(r.tokens != r.output_tokens for r in ok),  # fewer tokens than asked (context end)
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "duration_s": wall,
        "throughput_rps": rate(len(ok)),
        "output_tokens_per_s": rate(out_tokens),
        "input_tokens_per_s": rate(sum(r.input_tokens for r in ok)),
        "ttft_ms": stats([v for r in ok if (v := ttft_ms(r)) is not None]),
        "tpot_ms": stats([v for r in ok if (v := tpot_ms(r)) is not None]),
        "itl_ms": stats(itls),
        "e2e_ms": stats([e2e_ms(r) for r in ok]),
        "server_ttft_ms": stats([r.server_ttft_ms for r in ok if r.server_ttft_ms is not None]),
        # client TTFT − the router's own (receipt → first token sent): the network and both ends' send/receive delays
        "ttft_gap_ms": stats([t - r.server_ttft_ms for r in ok if r.server_ttft_ms and (t := ttft_ms(r)) is not None]),
        "itl_ms_quantiles": np.percentile(itls, np.arange(101)).tolist() if len(itls) else [],
        "client_lag_ms": stats(lag),
        "goodput_rps": rate(good),
        "slo_met": good,
        "slo_attainment": good / len(records) if records else None,
    }


def request_rows(records: Sequence[RequestRecord], slo: SLO, token_times: bool = False) -> dict[str, Any]:
    """The requests in column form ({"columns": [...], "rows": [[...], ...]}); with `token_times` each row also
    has its chunks' arrival times (ms after its send) and token counts."""

    def r3(x: float | None) -> float | None:
        return None if x is None else round(x, 3)

    cols = list(REQUEST_COLUMNS) + (["chunk_ms", "chunk_tokens"] if token_times else [])
    rows = []
    for r in records:
        itl = itl_ms(r)
        row: list[Any] = [
            r.index,
            r.input_tokens,
            r.output_tokens,
            r.tokens,
            r.cached_tokens,
            r.status,
            r3(r.scheduled_s),
            r3(r.send_s),
            r3(ttft_ms(r)),
            r3(tpot_ms(r)),
            r3(e2e_ms(r)),
            r3(float(itl.max())) if len(itl) else None,
            r3(r.server_ttft_ms),
            meets_slo(r, slo),
        ]
        if token_times:
            row += [[round((t - r.send_s) * 1e3, 3) for t in r.chunk_s], list(r.chunk_tokens)]
        rows.append(row)
    return {"columns": cols, "rows": rows}


def column(run: dict[str, Any], name: str) -> list[Any]:
    """One column of a run's request table (as written by `request_rows`)."""
    table = run["requests"]
    k = table["columns"].index(name)
    return [row[k] for row in table["rows"]]


def sweep(runs: Sequence[dict[str, Any]], slo: SLO) -> dict[str, Any]:
    """One row per run (its rate or concurrency, goodput, attainment, p90 TTFT / TPOT) and the highest rate whose
    attainment reaches slo.attainment (None when none does, or the runs have no rate)."""
    rows = []
    for run in runs:
        s = run["summary"]
        rows.append(
            {
                "rate": run.get("rate"),
                "concurrency": run.get("concurrency"),
                "throughput_rps": s["throughput_rps"],
                "goodput_rps": s["goodput_rps"],
                "slo_attainment": s["slo_attainment"],
                "ttft_ms_p90": s["ttft_ms"]["p90"],
                "tpot_ms_p90": s["tpot_ms"]["p90"],
                "e2e_ms_p90": s["e2e_ms"]["p90"],
                "errors": sum(s["errors"].values()),
            }
        )
    meeting = [
        r["rate"] for r in rows if r["rate"] is not None and (r["slo_attainment"] or 0.0) >= slo.attainment - 1e-12
    ]
    return {"rows": rows, "max_rate_meeting_slo": max(meeting) if meeting else None}


def table(runs: Sequence[dict[str, Any]]) -> str:
    """A text table of the runs for the terminal."""
    head = (
        f"{'load':>10s} {'req':>5s} {'err':>4s} {'req/s':>7s} {'tok/s':>8s} {'TTFT p50':>9s} {'p90':>8s} {'p99':>8s} "
        f"{'TPOT p50':>9s} {'p90':>7s} {'p99':>7s} {'ITL p90':>8s} {'E2E p90':>9s} {'goodput':>8s} {'SLO met':>7s}"
    )

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = [head]
    for run in runs:
        s = run["summary"]
        att = None if s["slo_attainment"] is None else 100 * s["slo_attainment"]
        load = f"{run['rate']:g}/s" if run.get("rate") is not None else f"c={run.get('concurrency') or 'trace'}"
        lines.append(
            f"{load:>10s} {s['num_requests']:5d} {sum(s['errors'].values()):4d} {f(s['throughput_rps'], '7.2f')} "
            f"{f(s['output_tokens_per_s'], '8.1f')} {f(s['ttft_ms']['p50'], '9.1f')} {f(s['ttft_ms']['p90'], '8.1f')} "
            f"{f(s['ttft_ms']['p99'], '8.1f')} {f(s['tpot_ms']['p50'], '9.2f')} {f(s['tpot_ms']['p90'], '7.2f')} "
            f"{f(s['tpot_ms']['p99'], '7.2f')} {f(s['itl_ms']['p90'], '8.2f')} {f(s['e2e_ms']['p90'], '9.1f')} "
            f"{f(s['goodput_rps'], '8.2f')} {f(att, '6.1f')}%"
        )
    return "\n".join(lines)
