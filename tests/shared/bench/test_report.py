"""pdserve.bench.report / plots / cli helpers: latency definitions, percentiles, goodput and sweeps on records with
known times; the plots and the JSON merge on documents built from them."""

from __future__ import annotations

import pytest

from pdserve.bench.cli import SCHEMA, _command, merge
from pdserve.bench.plots import write_plots
from pdserve.bench.report import (
    SLO,
    column,
    e2e_ms,
    itl_ms,
    meets_slo,
    request_rows,
    stats,
    summarize,
    sweep,
    table,
    tpot_ms,
    ttft_ms,
)
from pdserve.bench.runner import RequestRecord


def rec(index=0, send=1.0, chunks=(1.1, 1.12, 1.14), counts=None, end=1.15, status="OK", out=3, sched=None):
    return RequestRecord(
        index,
        input_tokens=10,
        output_tokens=out,
        scheduled_s=sched,
        send_s=send,
        end_s=end,
        chunk_s=list(chunks),
        chunk_tokens=list(counts or [1] * len(chunks)),
        status=status,
        error="" if status == "OK" else "why",
    )


def test_per_request_definitions():
    r = rec()
    assert ttft_ms(r) == pytest.approx(100.0)
    assert tpot_ms(r) == pytest.approx(20.0)  # (1.14 - 1.10) / (3 - 1)
    assert itl_ms(r).tolist() == pytest.approx([20.0, 20.0])
    assert e2e_ms(r) == pytest.approx(150.0)
    # a chunk of 3 tokens: TPOT counts tokens, ITL counts gaps between chunks
    r = rec(chunks=(1.1, 1.16), counts=[1, 3], out=4)
    assert r.tokens == 4 and tpot_ms(r) == pytest.approx(20.0) and itl_ms(r).tolist() == pytest.approx([60.0])
    one = rec(chunks=(1.2,), out=1)
    assert tpot_ms(one) is None and ttft_ms(one) == pytest.approx(200.0)
    failed = rec(chunks=(), status="UNAVAILABLE")
    assert ttft_ms(failed) is None and tpot_ms(failed) is None


def test_meets_slo():
    assert not meets_slo(rec(), SLO(350, 15))  # TPOT 20 ms
    assert meets_slo(rec(), SLO(350, 20))  # bounds are inclusive
    assert not meets_slo(rec(), SLO(99, 25))  # TTFT 100 ms
    assert meets_slo(rec(chunks=(1.2,), out=1), SLO(200, 0.001))  # one token: only TTFT applies
    assert not meets_slo(rec(status="DEADLINE_EXCEEDED"), SLO(1e9, 1e9))
    assert not meets_slo(rec(chunks=()), SLO(1e9, 1e9))  # ended without a token


def test_stats_percentiles():
    s = stats(range(1, 101))
    assert (s["count"], s["mean"], s["max"]) == (100, 50.5, 100.0)
    assert (s["p50"], s["p90"], s["p99"]) == pytest.approx((50.5, 90.1, 99.01))  # linear interpolation
    assert stats([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def records_at(rate_tpot: float, n_bad: int = 0) -> list[RequestRecord]:
    """10 requests sent 1 s apart (10 s run), TPOT `rate_tpot` ms; the last `n_bad` failed."""
    out = []
    for i in range(10):
        send = float(i)
        chunks = [send + 0.1 + k * rate_tpot / 1e3 for k in range(5)]
        status = "RESOURCE_EXHAUSTED" if i >= 10 - n_bad else "OK"
        r = rec(i, send, chunks if status == "OK" else [], end=send + 0.5, status=status, out=5, sched=send - 0.002)
        out.append(r)
    return out


def test_summarize_goodput_errors_throughput():
    records = records_at(10.0, n_bad=2)
    records[0].chunk_s = records[0].chunk_s[:4]  # one short output
    records[0].chunk_tokens = records[0].chunk_tokens[:4]
    records[1].server_ttft_ms = 60.0  # the router saw 60 ms of the client's 100
    s = summarize(records, SLO(350, 15))
    assert s["ttft_gap_ms"]["count"] == 1 and s["ttft_gap_ms"]["p50"] == pytest.approx(40.0)
    assert s["num_requests"] == 10 and s["completed"] == 8
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 2} and s["error_examples"] == {"RESOURCE_EXHAUSTED": "why"}
    assert s["short_outputs"] == 1
    assert s["duration_s"] == pytest.approx(9.5)  # first send 0 → last end 9.5
    assert s["throughput_rps"] == pytest.approx(8 / 9.5)
    assert s["output_tokens_per_s"] == pytest.approx((7 * 5 + 4) / 9.5)
    assert s["goodput_rps"] == pytest.approx(8 / 9.5) and s["slo_met"] == 8
    assert s["slo_attainment"] == pytest.approx(0.8)  # failed requests count against it
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0) and s["tpot_ms"]["p90"] == pytest.approx(10.0)
    assert s["itl_ms"]["count"] == 3 + 7 * 4 and len(s["itl_ms_quantiles"]) == 101
    assert s["client_lag_ms"]["p50"] == pytest.approx(2.0)
    s = summarize(records_at(20.0), SLO(350, 15))
    assert s["goodput_rps"] == 0 and s["slo_attainment"] == 0 and s["throughput_rps"] == pytest.approx(10 / 9.5)


def doc_of(runs_spec: list[tuple[float, float, int]], slo: SLO | None = None) -> dict:
    """A bench document with one run per (rate, tpot_ms, failures)."""
    slo = slo or SLO()
    runs = []
    for rate, tpot, bad in runs_spec:
        records = records_at(tpot, bad)
        runs.append(
            {
                "rate": rate,
                "concurrency": None,
                "summary": summarize(records, slo),
                "requests": request_rows(records, slo),
            }
        )
    return {
        "schema": SCHEMA,
        "command": "pdserve bench ...",
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "attainment": slo.attainment},
        "runs": runs,
        "sweep": sweep(runs, slo),
    }


def test_sweep_highest_rate_meeting_the_attainment():
    doc = doc_of([(1.0, 10, 0), (2.0, 10, 1), (4.0, 10, 5)])  # attainment 1.0, 0.9, 0.5
    assert [r["slo_attainment"] for r in doc["sweep"]["rows"]] == pytest.approx([1.0, 0.9, 0.5])
    assert doc["sweep"]["max_rate_meeting_slo"] == 2.0  # 0.9 counts (>=)
    assert doc["sweep"]["rows"][0]["tpot_ms_p90"] == pytest.approx(10.0)
    assert doc_of([(1.0, 20, 0)])["sweep"]["max_rate_meeting_slo"] is None
    strict = doc_of([(1.0, 10, 0), (2.0, 10, 1)], SLO(attainment=0.95))
    assert strict["sweep"]["max_rate_meeting_slo"] == 1.0
    assert "2/s" in table(doc["runs"]) and "50.0%" in table(doc["runs"])


def test_request_rows_columns_and_token_times():
    records = records_at(10.0, n_bad=1)
    table_ = request_rows(records, SLO())
    run = {"requests": table_}
    assert column(run, "status")[-1] == "RESOURCE_EXHAUSTED" and column(run, "ttft_ms")[-1] is None
    assert column(run, "tpot_ms")[0] == pytest.approx(10.0) and column(run, "meets_slo")[:2] == [True, True]
    assert "chunk_ms" not in table_["columns"]
    full = request_rows(records, SLO(), token_times=True)
    k = full["columns"].index("chunk_ms")
    assert full["rows"][0][k] == pytest.approx([100.0, 110.0, 120.0, 130.0, 140.0])  # ms after send
    assert full["rows"][0][k + 1] == [1] * 5


def test_merge_for_append():
    a, b = doc_of([(1.0, 10, 0), (4.0, 10, 5)]), doc_of([(2.0, 10, 1)])
    m = merge(a, b)
    assert [r["rate"] for r in m["runs"]] == [1.0, 2.0, 4.0]
    assert m["sweep"]["max_rate_meeting_slo"] == 2.0 and len(m["command"]) == 2
    with pytest.raises(ValueError, match="SLO"):
        merge(a, doc_of([(2.0, 10, 1)], SLO(ttft_ms=100)))
    with pytest.raises(ValueError, match="not a pdserve bench result"):
        merge({"schema": "x"}, b)


def test_command_masks_the_token():
    assert _command(["--target", "h:1", "--token", "s3cret", "--rate", "2"]) == (
        "pdserve bench --target h:1 --token '***' --rate 2"
    )
    assert "s3cret" not in _command(["--token=s3cret"])


def test_plots_written(tmp_path):
    png = b"\x89PNG\r\n\x1a\n"
    one = doc_of([(1.0, 10, 0)])
    paths = write_plots([("a", one)], tmp_path / "one")
    assert [p.name for p in paths] == ["latency_cdf.png"]  # one run: no sweep plot
    two = doc_of([(1.0, 10, 0), (2.0, 12, 1), (4.0, 20, 3)])
    paths = write_plots([("disagg", two), ("colocated", doc_of([(1.0, 14, 0), (2.0, 20, 2)]))], tmp_path / "two")
    assert sorted(p.name for p in paths) == ["latency_cdf.png", "sweep.png"]
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(png) and len(data) > 20_000
    # runs by concurrency (and a mix with rates, as --append can make): each plot keeps one kind
    conc = doc_of([(1.0, 10, 0), (2.0, 12, 1)])
    for k, run in enumerate(conc["runs"]):
        run["rate"], run["concurrency"] = None, 4 * (k + 1)
    conc["sweep"] = sweep(conc["runs"], SLO())
    assert len(write_plots([("c", conc)], tmp_path / "conc")) == 2
    mixed = merge(doc_of([(1.0, 10, 0), (2.0, 12, 1)]), conc)
    assert len(write_plots([("m", mixed)], tmp_path / "mixed")) == 2
