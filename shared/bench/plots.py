"""PNG plots of `pdserve bench` results (matplotlib, no display: `Figure` objects render with Agg).

- `latency_cdf.png`: CDFs of TTFT, TPOT, ITL and end-to-end latency, one line per run (rate or concurrency), the
  SLO marked on TTFT and TPOT;
- `sweep.png` (two runs or more): goodput, SLO attainment, p90 TTFT and p90 TPOT against the rate (or concurrency).
Several results (e.g. disaggregated and colocated) draw into the same plots, one colour family per result.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.report import column

Result = tuple[str, dict[str, Any]]  # (label, the JSON document `pdserve bench` writes)


def _figure(rows: int, cols: int, size: tuple[float, float]):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'pdserve[bench]'") from None
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def load_label(run: dict[str, Any]) -> str:
    if run.get("rate") is not None:
        return f"{run['rate']:g} req/s"
    if run.get("concurrency") is not None:
        return f"concurrency {run['concurrency']}"
    return "trace"


def _ok(run: dict[str, Any], name: str) -> np.ndarray:
    status = column(run, "status")
    return np.asarray([v for v, s in zip(column(run, name), status) if s == "OK" and v is not None], dtype=float)


def _cdf(ax, values: np.ndarray, **kw) -> None:
    if len(values):
        x = np.sort(values)
        ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", **kw)


def _colors(n_results: int, n_runs: int):
    """A colour per (result, run): one colormap per result, darker for higher load."""
    from matplotlib import colormaps

    maps = ["Blues", "Oranges", "Greens", "Purples", "Reds", "Greys"]
    return [
        [colormaps[maps[k % len(maps)]](0.45 + 0.5 * (j / max(1, n_runs - 1))) for j in range(n_runs)]
        for k in range(n_results)
    ]


def plot_cdfs(results: Sequence[Result], path: str | Path) -> Path:
    """TTFT / TPOT / ITL / E2E CDFs of every run of every result, written to `path`."""
    fig, axes = _figure(2, 2, (12, 8))
    panels = [
        (axes[0][0], "ttft_ms", "TTFT (ms)", "ttft_ms"),
        (axes[0][1], "tpot_ms", "TPOT (ms)", "tpot_ms"),
        (axes[1][0], None, "ITL (ms)", None),
        (axes[1][1], "e2e_ms", "end-to-end latency (ms)", None),
    ]
    colors = _colors(len(results), max(len(doc["runs"]) for _, doc in results))
    for k, (label, doc) in enumerate(results):
        for j, run in enumerate(doc["runs"]):
            name = f"{label} {load_label(run)}".strip()
            for ax, col, _, _ in panels:
                if col is not None:
                    _cdf(ax, _ok(run, col), color=colors[k][j], label=name)
                elif run["summary"]["itl_ms_quantiles"]:  # ITL: the run's 101 quantiles
                    ax.plot(run["summary"]["itl_ms_quantiles"], np.linspace(0, 1, 101), color=colors[k][j], label=name)
    slo = results[0][1]["slo"]
    for ax, _, title, slo_key in panels:
        if slo_key is not None:
            ax.axvline(slo[slo_key], color="red", linestyle="--", linewidth=1, label=f"SLO {slo[slo_key]:g} ms")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if title != "ITL (ms)" else "fraction of gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("pdserve bench: latency CDFs (successful requests)")
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def plot_sweep(results: Sequence[Result], path: str | Path) -> Path | None:
    """Goodput, SLO attainment, p90 TTFT and p90 TPOT against the rate (or, without rates, the concurrency), one
    line per result; None (nothing written) when no result has two such runs."""
    by_rate = any(row["rate"] is not None for _, doc in results for row in doc["sweep"]["rows"])
    key = "rate" if by_rate else "concurrency"  # runs of the other kind (or traces) are left out of this plot
    sweeps = [(label, [row for row in doc["sweep"]["rows"] if row[key] is not None]) for label, doc in results]
    if not any(len(rows) >= 2 for _, rows in sweeps):
        return None
    fig, axes = _figure(2, 2, (12, 8))
    (ax_good, ax_att), (ax_ttft, ax_tpot) = axes
    colors = _colors(len(results), 1)
    top = 0.0
    for k, ((label, rows), (_, doc)) in enumerate(zip(sweeps, results)):
        if not rows:
            continue
        x = [row[key] for row in rows]
        style = dict(color=colors[k][0], marker="o", label=label or None)
        ax_good.plot(x, [row["goodput_rps"] for row in rows], **style)
        ax_att.plot(x, [100 * (row["slo_attainment"] or 0.0) for row in rows], **style)
        ax_ttft.plot(x, [row["ttft_ms_p90"] for row in rows], **style)
        ax_tpot.plot(x, [row["tpot_ms_p90"] for row in rows], **style)
        best = doc["sweep"]["max_rate_meeting_slo"]
        if best is not None and by_rate:
            ax_att.axvline(best, color=colors[k][0], linestyle=":", linewidth=1)
        top = max(top, *x)
    slo = results[0][1]["slo"]
    if by_rate:
        ax_good.plot([0, top], [0, top], color="grey", linestyle=":", linewidth=1, label="offered load")
    ax_att.axhline(100 * slo["attainment"], color="red", linestyle="--", linewidth=1, label="target")
    ax_ttft.axhline(slo["ttft_ms"], color="red", linestyle="--", linewidth=1, label=f"SLO {slo['ttft_ms']:g} ms")
    ax_tpot.axhline(slo["tpot_ms"], color="red", linestyle="--", linewidth=1, label=f"SLO {slo['tpot_ms']:g} ms")
    xlabel = "request rate (req/s)" if by_rate else "concurrency"
    for ax, ylabel in (
        (ax_good, "goodput (req/s meeting TTFT and TPOT SLOs)"),
        (ax_att, "requests meeting the SLO (%)"),
        (ax_ttft, "p90 TTFT (ms)"),
        (ax_tpot, "p90 TPOT (ms)"),
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in (ax_good, ax_ttft, ax_tpot):
        ax.set_ylim(bottom=0)
    ax_att.set_ylim(0, 105)
    fig.suptitle(f"pdserve bench: SLO TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms")
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def write_plots(results: Sequence[Result], out_dir: str | Path) -> list[Path]:
    """Both plots into `out_dir` (created); the paths written."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    written = [plot_cdfs(results, d / "latency_cdf.png")]
    sweep_png = plot_sweep(results, d / "sweep.png")
    return written + ([sweep_png] if sweep_png else [])
